"""Serving: an OpenAI-compatible HTTP frontend in front of the engine ranks, routed over pyzmq.

    torchrun --nproc-per-node N -m adaptive_dist serve --dp D [...]     # or one process, no torchrun

Processes and sockets (the README's "Serving" section has the whole picture):

- rank 0 binds the HTTP port first; every rank binds a PULL inbox (an ipc endpoint in a private
  directory on one host, TCP across hosts); rank 0 gathers the addresses and shares the job's
  secret (``launch.gather_addresses``, ``launch.job_secret``) and spawns the frontend process
  (``frontend.py``: FastAPI + uvicorn) with both in its environment and the listening socket;
- every message between them is sealed with the secret (``channel``: HMAC-SHA256, per-direction
  keys, per-sender counters); what is not is dropped and counted, never fatal;
- the frontend PUSHes every control message (``protocol.Generate`` / ``Abort`` / ``Shutdown``) to
  every rank in one global ``seq`` order; ranks apply them strictly in order
  (``inbox.Inbox.take_upto``), and only the ranks of the chosen DP group add a request;
- the leader of each DP group PUSHes token deltas, errors and queue statistics back
  (``rank.RankLoop``); every rank sends heartbeats, so the frontend notices a dead rank.

Modules: ``protocol`` (messages), ``channel`` (sealing, endpoints), ``inbox`` (rank-side
sockets), ``engine_glue`` (the only code that touches the engine), ``rank`` (the rank loop),
``launch`` (the ``serve`` command on a rank), ``perimeter`` (the HTTP side's limits: port,
connection cap, timers, body size), ``render`` (chat template renders in bounded worker
processes),
``admission`` (the ranges of a request's values, checked by the frontend and again by every rank),
``frontend`` / ``api`` / ``openai_io`` / ``chat`` / ``text`` / ``router`` / ``metrics`` (the
frontend process; ``chat`` renders chat templates), ``client`` and ``cli`` (the ``client``
command, the entry points and the flags' other spellings).

docs/serving.md specifies the endpoints, the request fields' ranges, how stop strings and stop
tokens count, chat templates, and when a rank refuses a request (every rank of the replica
alike, in the same round).
"""
