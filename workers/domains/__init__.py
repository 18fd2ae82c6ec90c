"""Task domains, the pure half: what a task of each domain kind looks like, and what the model is shown.

* ``kinds``: one definition per domain kind — the JSONL row a person writes, the reference stored with
  the task, which verifier kinds can judge it, and example rows (the example files and the README's table
  are generated from them).
* ``prompts``: the per-domain prompt template (a system prompt, the task's visible fields) and its
  validation.

Pure: pydantic only; no Django, no torch. The importer (``webapp.catalog.task_import``) validates rows
with these models and the verifiers read references with them, so the two can never disagree.
"""
