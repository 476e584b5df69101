"""The models a recipe names: ``loading.py`` builds the tokenizer and the Hugging Face causal LM (weights or a
seeded random init) from the recipe's ``model`` section; ``specs.py`` knows the dimensions of the recipes' models
(and reads any local ``config.json``) for the parallel-layout check and the memory plan."""
