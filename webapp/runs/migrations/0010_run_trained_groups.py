"""``Run.trained_groups``: the groups a run has trained, by domain, kept by each step's record; counted once
here for the runs that already trained. An index of a run's groups, newest first (the health check reads the
latest few)."""

from django.db import migrations, models
from django.db.models import Count


def count_trained(apps, schema_editor):
    PromptGroup = apps.get_model("runs", "PromptGroup")
    Run = apps.get_model("runs", "Run")
    counts: dict[int, dict[str, int]] = {}
    for run_id, domain_id, n in (PromptGroup.objects.filter(status="trained").values_list("run_id", "domain_id")
                                 .annotate(n=Count("id")).order_by()):
        counts.setdefault(run_id, {})["" if domain_id is None else str(domain_id)] = n
    for run_id, trained in counts.items():
        Run.objects.filter(pk=run_id).update(trained_groups=trained)


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0009_trained_step_indexes'),
    ]

    operations = [
        migrations.AddField(
            model_name='run',
            name='trained_groups',
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.RunPython(count_trained, migrations.RunPython.noop),
        migrations.AddIndex(
            model_name='promptgroup',
            index=models.Index(fields=['run', '-id'], name='group_run_id'),
        ),
    ]
