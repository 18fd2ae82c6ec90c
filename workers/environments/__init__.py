"""Multi-turn environments: a rollout is an *episode* of an environment, text in and text out.

* ``base``: the protocol (one object per episode: ``start``, ``step``, ``score``, ``close``), observations,
  the transcript, and the registry of environments by name (imported lazily, like engines).
* ``episodes``: the episode runner — token-in, token-out, batched over many episodes, with the limits that
  end an episode (never a run) and the per-token loss mask.
* the environments: ``single_turn`` (today's tasks: the first step ends the episode), ``python_tool`` (a
  Python tool run in the episode's sandbox session), ``guess_number`` (higher/lower feedback on each guess).

Pure: no Django, no torch. An environment that runs code gets a ``sandboxes.session.Session``; the runner
gets the engine as plain callables.
"""
