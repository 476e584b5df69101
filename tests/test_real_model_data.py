"""The real tokenizer and chat template (SmolLM2-135M-Instruct, issue 46) through the data pipeline.

Every kind of data (preference, unpaired, grouped, rollout prompts), plain and conversational: the sequence the
pipeline builds is the one the model's own chat template renders for the whole conversation (so the
prompt/completion boundary falls where the template puts it), ``<|im_start|>`` (the BOS, id 1) is neither doubled
nor lost, each completion ends with exactly one ``<|im_end|>`` (the EOS, id 2), and the completion mask covers the
completion and its EOS only. Tokenizer only: no weights are loaded.
"""

from __future__ import annotations

import pytest
import torch

from real_model import REFERENCE

pytestmark = pytest.mark.usefixtures("real_model")  # a skip without the package; under CI=true a failure

PROMPT = "Describe the road."
CHOSEN, REJECTED = "The road is warm and wide.", "It is a cold road."
MAX_LENGTH, MAX_PROMPT = 128, 96


def _msgs(prompt, completion):
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


@pytest.fixture(scope="module")
def tok():
    """The tokenizer loaded the pack's way from a recipe's `model` section naming the package."""
    from hl_core.config.sections import ModelConfig
    from hl_core.models.loading import load_tokenizer

    return load_tokenizer(ModelConfig(name_or_path=REFERENCE))


def _template_ids(tok, messages, generation_prompt=False):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _check_sequence(tok, ids, mask, prompt_ids, completion):
    """``ids`` = prompt + completion + one EOS; the mask is 1 exactly on the completion and its EOS."""
    n = len(prompt_ids)
    assert ids[:n] == prompt_ids
    assert mask == [0] * n + [1] * (len(ids) - n)
    assert ids[-1] == tok.eos_token_id == 2 and ids[n:].count(2) == 1
    assert tok.decode(ids[n:-1]) == completion
    assert ids[:2].count(tok.bos_token_id) <= 1  # never a doubled BOS at the start


def test_the_tokenizer_is_the_models(tok):
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", 1, "<|im_end|>", 2)
    assert tok.pad_token_id == 2 and len(tok) == 49152
    assert tok("hi")["input_ids"] == tok("hi", add_special_tokens=False)["input_ids"]  # it adds no BOS itself
    assert "<|im_start|>assistant" in tok.chat_template


@pytest.mark.parametrize("form", ["conversational", "plain"])
def test_preference_pairs(tok, form):
    from hl_core.data import collate_preference, tokenize_preference
    from hl_core.data.preference import parse_preference_row

    if form == "conversational":
        row, template = {"chosen": _msgs(PROMPT, CHOSEN), "rejected": _msgs(PROMPT, REJECTED)}, "auto"
        prompt_ids = _template_ids(tok, [{"role": "user", "content": PROMPT}], generation_prompt=True)
        assert prompt_ids[0] == tok.bos_token_id and prompt_ids[1] != tok.bos_token_id  # the template's BOS, once
    else:
        row, template = {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}, "none"
        prompt_ids = list(tok(PROMPT + "\n\n")["input_ids"])  # what the tokenizer itself does: no BOS added
        assert tok.bos_token_id not in prompt_ids
    feature = tokenize_preference(parse_preference_row(row, "t:1"), tok, MAX_LENGTH, MAX_PROMPT, template)
    for key, text in (("chosen", CHOSEN), ("rejected", REJECTED)):
        ids, mask = feature[f"{key}_input_ids"], feature[f"{key}_completion_mask"]
        _check_sequence(tok, ids, mask, prompt_ids, text)
        if form == "conversational":  # the whole conversation as the model's template renders it, up to <|im_end|>
            full = _template_ids(tok, _msgs(PROMPT, text))
            assert ids == full[: full.index(2, len(prompt_ids)) + 1]
    batch = collate_preference([feature], tok.pad_token_id)
    assert torch.equal(batch["completion_mask"] * batch["attention_mask"], batch["completion_mask"])
    assert int(batch["completion_mask"][1].sum()) == len(feature["rejected_input_ids"]) - len(prompt_ids)


def test_unpaired_examples(tok):
    from hl_core.data.unpaired import parse_unpaired_row, tokenize_unpaired

    records = parse_unpaired_row({"prompt": [{"role": "user", "content": PROMPT}], "completion": CHOSEN,
                                  "label": True}, "t:1")
    feature = tokenize_unpaired(records[0], tok, MAX_LENGTH, MAX_PROMPT)
    prompt_ids = _template_ids(tok, [{"role": "user", "content": PROMPT}], generation_prompt=True)
    ids = feature["prompt_ids"] + feature["completion_ids"]
    _check_sequence(tok, ids, [0] * len(feature["prompt_ids"]) + [1] * len(feature["completion_ids"]), prompt_ids,
                    CHOSEN)
    full = _template_ids(tok, _msgs(PROMPT, CHOSEN))
    assert ids == full[: full.index(2, len(prompt_ids)) + 1]
    plain = tokenize_unpaired(parse_unpaired_row({"prompt": PROMPT, "completion": CHOSEN, "label": 0}, "t:2")[0],
                              tok, MAX_LENGTH, MAX_PROMPT, "none")
    assert plain["prompt_ids"] == list(tok(PROMPT + "\n\n")["input_ids"]) and plain["completion_ids"].count(2) == 1


def test_grouped_completions_and_truncation(tok):
    from hl_core.data.grouped import collate_groups, parse_group_row, tokenize_group

    completions = [CHOSEN, REJECTED, "Warm. " * 40]  # the last is cut to fit max_length, EOS kept
    record = parse_group_row({"prompt": PROMPT, "completions": completions, "scores": [1.0, 0.0, 0.5]}, "t:1")
    feature = tokenize_group(record, tok, 64, 40)
    prompt_ids = _template_ids(tok, [{"role": "user", "content": PROMPT}], generation_prompt=True)
    for ids, mask, text in zip(feature["input_ids"][:2], feature["completion_mask"][:2], completions[:2]):
        _check_sequence(tok, ids, mask, prompt_ids, text)
    long_ids = feature["input_ids"][2]
    assert len(long_ids) == 64 and long_ids[-1] == 2 and long_ids[len(prompt_ids):].count(2) == 1
    batch = collate_groups([feature], tok.pad_token_id)
    assert batch["completion_mask"].sum(1).tolist() == [len(ids) - len(prompt_ids) for ids in feature["input_ids"]]
    assert torch.equal(batch["completion_mask"] * batch["attention_mask"], batch["completion_mask"])


def test_rollout_prompts_with_a_system_prompt(tok):
    from hl_core.data.prompts import parse_prompt_row, tokenize_prompt

    record = parse_prompt_row({"prompt": "What is 21 + 39?", "answer": "60"}, "t:1",
                              system_prompt="Answer with the number only.")
    feature = tokenize_prompt(record, tok, MAX_LENGTH, MAX_PROMPT)
    expected = _template_ids(tok, [{"role": "system", "content": "Answer with the number only."},
                                   {"role": "user", "content": "What is 21 + 39?"}], generation_prompt=True)
    assert feature["prompt_ids"] == expected and feature["reference"] == "60"
    assert expected[0] == 1 and expected[1] != 1
    assert tok.decode(expected).endswith("<|im_start|>assistant\n")
    assert "You are a helpful AI assistant" not in tok.decode(expected)  # the recipe's system prompt replaces it
