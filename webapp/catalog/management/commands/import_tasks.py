"""``python manage.py import_tasks DOMAIN FILE``: import JSONL tasks into a domain, all or nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from webapp.catalog.models import TaskDomain
from webapp.catalog.services import ImportFailed, do_import_tasks


class Command(BaseCommand):
    help = "Import tasks from a JSONL file into a domain (by name or id). A file with bad rows imports nothing."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("domain", help="domain name or id")
        parser.add_argument("file", type=Path)
        parser.add_argument("--owner", help="username owning the domain, when names are ambiguous")

    def handle(self, *args: Any, **opts: Any) -> None:
        ref: str = opts["domain"]
        domains = TaskDomain.objects.all()
        if opts["owner"]:
            domains = domains.filter(owner__username=opts["owner"])
        matches = list(domains.filter(pk=int(ref)) if ref.isdigit() else domains.filter(name=ref))
        if not matches:
            raise CommandError(f"no domain named {ref!r}")
        if len(matches) > 1:
            raise CommandError(f"{len(matches)} domains are named {ref!r}: give --owner or the domain id")
        path: Path = opts["file"]
        if not path.is_file():
            raise CommandError(f"{path}: no such file")
        size = path.stat().st_size
        with path.open("rb") as fh, tqdm(total=size, unit="B", unit_scale=True, desc=f"import {path.name}") as bar:
            def lines() -> Any:
                for line in fh:
                    bar.update(len(line))
                    yield line
            try:
                result = do_import_tasks(matches[0], lines())
            except ImportFailed as exc:
                bar.close()
                for err in exc.result.errors:
                    self.stderr.write(f"{path}:{err.line}: {err.field}: {err.reason}")
                raise CommandError(exc.message) from None
        self.stdout.write(self.style.SUCCESS(
            f"imported {result.imported} tasks ({result.heldout} held out) into {matches[0].name}; "
            f"it now holds {matches[0].task_count}"
        ))
