"""``trainguard chaos``: the GPT example under random faults of workers and of trainguard's
own parts for minutes, then a fault-free run of the same job, and the comparison.

- ``faults``: the fault menu (each fault a real signal to a real process, or a flipped byte in
  a real snapshot, replica or durable file) and the helpers that find a run's processes;
- ``run``: the settings, the job and its reference, the summary and its verdict.

Above every other package but the CLI: it starts ``trainguard run`` and reads what the
controller's store and the checkpoint tiers hold.
"""
