"""The sandbox runtimes a domain names, as its page shows them: name, build status on this machine, image
size, packages and lock (``sandboxes.runtimes``; nothing is built here — building is the verify workers' or
``python -m sandboxes.runtimes build``'s job).

A domain names a runtime through its verifier's config (``python_tests``, ``command``: ``runtime``) and, for
an environment with sessions, its ``environment_params`` (``python_tool``: ``runtime``). No Django model: the
definitions are files (``runtimes/*.toml``) and the images a directory, read the same way by every process.
"""

from __future__ import annotations

from typing import Any


def runtime_names(domain: Any) -> dict[str, str]:
    """runtime name -> what names it (the verifier, the environment), in that order."""
    names: dict[str, str] = {}
    verifier = getattr(domain, "verifier", None)
    if verifier is not None and verifier.kind in ("python_tests", "command"):
        names[str((verifier.config or {}).get("runtime") or "python")] = "verifier"
    env_runtime = (domain.environment_params or {}).get("runtime") if domain.environment != "single_turn" else None
    if env_runtime or domain.environment == "python_tool":
        name = str(env_runtime or "python")
        names[name] = f"{names[name]} and environment" if name in names else "environment"
    return names


def domain_runtimes(domain: Any) -> list[dict[str, Any]]:
    """One row per runtime the domain names: its definition, status, size and lock, or the error."""
    from sandboxes import runtimes

    rows = []
    for name, named_by in runtime_names(domain).items():
        try:
            report = runtimes.report(runtimes.get(name)).to_dict()
        except ValueError as exc:  # undefined here, or an unusable image root
            report = {"runtime": {"name": name, "packages": [], "preload": []}, "status": "undefined",
                      "error": str(exc)}
        rows.append({**report, "named_by": named_by, "status_text": str(report["status"]).replace("_", " "),
                     "size_mb": None if not report.get("size_bytes") else round(report["size_bytes"] / 1e6, 1)})
    return rows
