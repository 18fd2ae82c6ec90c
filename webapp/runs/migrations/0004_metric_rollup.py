"""Metric rollups (min/max per bucket at three widths), filled for the points that already exist."""

import django.db.models.deletion
from django.db import migrations, models

WIDTHS = (32, 1024, 32768)  # webapp.runs.metrics.ROLLUP_WIDTHS at the time of this migration


def fill(apps, schema_editor):
    connection = schema_editor.connection
    point = apps.get_model("runs", "MetricPoint")._meta.db_table
    rollup = apps.get_model("runs", "MetricRollup")._meta.db_table
    with connection.cursor() as cursor:
        for level, width in enumerate(WIDTHS):
            cursor.execute(
                f"INSERT INTO {rollup} (run_id, name, domain_key, level, bucket, step_lo, step_hi, v_min, v_max, n, "
                f"seq_max) SELECT run_id, name, COALESCE(domain_id, 0), {level}, "
                f"CAST(FLOOR(step * 1.0 / {width}) AS BIGINT) AS b, MIN(step), MAX(step), MIN(value), MAX(value), "
                f"COUNT(*), MAX(seq) FROM {point} GROUP BY run_id, name, COALESCE(domain_id, 0), b"
            )


class Migration(migrations.Migration):

    dependencies = [
        ("runs", "0003_loop_health"),
    ]

    operations = [
        migrations.CreateModel(
            name="MetricRollup",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("name", models.CharField(max_length=128)),
                ("domain_key", models.BigIntegerField(default=0)),
                ("level", models.PositiveSmallIntegerField()),
                ("bucket", models.BigIntegerField()),
                ("step_lo", models.BigIntegerField()),
                ("step_hi", models.BigIntegerField()),
                ("v_min", models.FloatField()),
                ("v_max", models.FloatField()),
                ("n", models.PositiveIntegerField()),
                ("seq_max", models.BigIntegerField()),
                ("run", models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE,
                                          related_name="+", to="runs.run")),
            ],
            options={
                "constraints": [models.UniqueConstraint(fields=("run", "name", "domain_key", "level", "bucket"),
                                                        name="metricrollup_key")],
            },
        ),
        migrations.RunPython(fill, migrations.RunPython.noop),
    ]
