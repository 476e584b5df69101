"""The training loop's machinery; the loop itself is ``hl_core/trainer.py``.

* ``sources.py``: the seeded data order and the offline source of each update's micro-batches;
* ``micro_batches.py``: one update's examples as micro-batches (fixed or by token budget), and how their losses
  and metrics combine so the split never changes them;
* ``metrics.py``: declared metric keys and their means over micro-batches and ranks;
* ``guard.py``: what stops a run (non-finite updates, signals) and with which exit code;
* ``safety.py``: the non-finite decision, checkpoint and ``final/`` writes (mixed into the trainer);
* ``report.py`` and ``sinks.py``: progress bar, printed lines, ``metrics.jsonl`` / TensorBoard / W&B, the summary;
* ``lifecycle.py`` and ``run_record.py``: a run's start in its ``output_dir`` (the lock, another run's outputs, the
  checkpoint to resume and whether its run record allows it) and the line a finished run's rerun prints;
* ``post_training.py``: the post-training evaluations' phase and what ``summary.json`` says about it; the
  evaluations run in a child process (``eval_child.py``) that a signal to the run stops.
"""
