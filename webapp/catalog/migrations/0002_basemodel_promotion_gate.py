from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("catalog", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="basemodel",
            name="promotion_gate",
            field=models.JSONField(
                blank=True, default=dict,
                help_text="What promotion to a gated alias requires (webapp/runs/evaluation.py GateConfig): aliases, "
                          "require_no_regression, min_gain, suite. Empty: the defaults.",
            ),
        ),
    ]
