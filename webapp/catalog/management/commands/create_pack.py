"""``python manage.py create_pack PACK``: many generator domains at once, each verifier calibrated, with a progress bar."""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from webapp.catalog.packs import PACKS, PackItem, do_create_pack, pack_items
from webapp.common.errors import ValidationFailed


class Command(BaseCommand):
    help = ("Create a pack of generator domains (built in: " + ", ".join(PACKS) + "), each with its verifier "
            "calibrated; the domains that cannot be made are named with the reason and the rest are created.")

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("pack", help="a built-in pack, or your pack's name with --items")
        parser.add_argument("--owner", default="demo", help="username owning the domains (default: demo)")
        parser.add_argument("--items", help='a JSON list of {"generator", "params", "name"} instead of the pack\'s')
        parser.add_argument("--only", help="comma-separated domain names of the pack to create (the rest are skipped)")
        parser.add_argument("--prefix", help="domain names are <prefix>/<name> (default: the pack's name)")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--heldout-size", type=int, default=100)
        parser.add_argument("--tag", action="append", default=[], help="a tag for every domain (repeatable)")

    def handle(self, *args: Any, **opts: Any) -> None:
        owner = get_user_model().objects.filter(username=opts["owner"]).first()
        if owner is None:
            raise CommandError(f"no user {opts['owner']!r} (create one, or pass --owner)")
        try:
            if opts["items"]:
                items = [PackItem(i["generator"], dict(i.get("params") or {}), i.get("name", ""))
                         for i in json.loads(opts["items"])]
            else:
                items = pack_items(opts["pack"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CommandError(f"--items: {exc}") from None
        except ValidationFailed as exc:
            raise CommandError(exc.message) from None
        if opts["only"]:
            wanted = set(opts["only"].split(","))
            items = [i for i in items if i.short_name() in wanted]
        with tqdm(total=len(items), unit="domain", desc=f"pack {opts['prefix'] or opts['pack']}",
                  file=self.stderr._out) as bar:
            def progress(name: str, reason: str | None) -> None:
                bar.set_postfix_str(name[-40:])
                bar.update(1)

            result = do_create_pack(owner, opts["pack"], items, prefix=opts["prefix"], seed=opts["seed"],
                                    heldout_size=opts["heldout_size"], tags=opts["tag"], progress=progress)
        for name, reason in result.failed:
            self.stderr.write(f"not created: {name}: {reason}")
        self.stdout.write(self.style.SUCCESS(f"created {len(result.created)} domain(s) of {len(items)}; "
                                             f"{len(result.failed)} left out"))
        if not result.created:
            raise CommandError("no domain of the pack could be created")
