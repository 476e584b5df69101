"""What the core writes and reads on disk, in formats no other package decides: the run directory's checkpoints
(``checkpoints.py``: complete-or-invisible saves and their ``complete.json``, ``final/``, the resume target, and the
one safe way to load a torch file), its lock (``run_lock.py``: one run per ``output_dir``), file digests
(``digests.py``), user text files (``text.py``: UTF-8, or the place of the first bad byte), and models shipped as a
GGUF file inside a Python package (``gguf_models.py``: converted once into an ordinary Hugging Face directory in a
cache, for ``model.name_or_path: gguf:PACKAGE/FILE.gguf``)."""
