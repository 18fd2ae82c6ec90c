"""The Django half of the generate → verify → train loop: one module per idea.

| module | what it does |
|---|---|
| ``tick`` | a run's rows → the pure scheduler's snapshot (``workers.pipeline.scheduler``) → its decisions applied: drops, work handed out again, the train claim, admission, completion, pause, revocation; ``recover_all`` is the periodic tick |
| ``admission`` | the scheduler's "admit n of domain d" as prompt groups (a per-domain data cursor; retries first) |
| ``generation`` | the GPU worker's rollout: claim groups, render prompts, sample under the run's own version, write samples |
| ``verification`` | judge a group's samples (three-valued verdicts), the ready buffer |
| ``training`` | claim B ready groups, advantages where the batch is assembled, one trainer step, version v+1 recorded |
| ``heldout`` | held-out evaluation: sample on the GPU worker, score on the verify queue, per task |
| ``reporting`` | a recorded step's metric points, health checks, the evaluation it is due for |
| ``alerts`` | the facts the pure alert rules judge (``workers.pipeline.alerts``), raised and cleared once |
| ``recovery`` | who is known gone, a broker that lost its messages, failed tasks' work handed out again |
| ``heartbeats`` | each worker's heartbeat row |
| ``live`` | typed websocket payloads and the one send helper; the device-busy clock |
| ``accounting`` | the books: every admitted group trained once or dropped with a reason |
| ``paths`` | where base models and policy versions live in the artifact store |

Celery tasks (``workers/tasks``) only turn a message's ids into one call of these; every message is sent by
name through ``workers.messages``, so nothing here imports ``workers.tasks``. Decisions are the pure
scheduler's; these modules read and write rows.
"""
