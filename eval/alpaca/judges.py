"""AlpacaEval judges: an API annotator config of the ``alpaca_eval`` package, a local reward model, or a
Python callable.

Preferences use alpaca_eval's convention: ``output_1`` is the reference (baseline) output, ``output_2`` the
evaluated model's; ``preference`` is 1 when the reference is better, 2 when the model is better, 1.5 for a
tie, and any value in [1, 2] for a soft preference (the win rate is ``100 * mean(preference - 1)``).

Judge specs (``--judge``):

* ``api:NAME`` -- an annotator config of the alpaca_eval package (e.g. ``weighted_alpaca_eval_gpt4_turbo``,
  the AlpacaEval 2 default) or a path to a ``configs.yaml``. ``api:weighted_alpaca_eval_gpt-4.1`` (the
  default; the humanline authors judged with GPT-4.1) is the AlpacaEval 2 weighted judge with the model set
  to ``gpt-4.1``, written out at run time. Needs ``OPENAI_API_KEY`` (and network).
* ``rm:MODEL`` -- a sequence-classification reward model (local directory or hub name, e.g.
  ``RLHFlow/ArmoRM-Llama3-8B-v0.1`` with ``trust_remote_code``) scores ``[user: instruction, assistant:
  output]`` for both outputs; the higher reward wins (``rm_mode="soft"``: preference ``1 + sigmoid(r2 - r1)``).
* ``py:MODULE:FUNCTION`` or ``py:path/to/file.py:FUNCTION`` -- ``FUNCTION(instruction, output_1, output_2)``
  returning a preference in [1, 2] (or a Python callable passed directly to `make_judge`).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import yaml

from .._common import EvalError, check_model_dir
from .compat import import_alpaca_eval

DEFAULT_API_JUDGE = "weighted_alpaca_eval_gpt-4.1"
RM_MODES = ("hard", "soft")


# --------------------------------------------------------------------------------------------- preferences


def check_preference(value: Any, where: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise EvalError(f"{where}: judge returned {value!r}, expected a preference number in [1, 2].") from None
    if not (1.0 <= v <= 2.0) or math.isnan(v):
        raise EvalError(
            f"{where}: judge returned {v}, outside [1, 2]. Fix: return 1 (reference better), 2 (model better), "
            f"1.5 (tie) or a value in between (alpaca_eval's preference convention)."
        )
    return v


def reward_preference(r_reference: float, r_model: float, mode: str = "hard") -> float:
    """Preference from two rewards: hard (2 / 1 / 1.5 on ties) or soft (``1 + sigmoid(r_model - r_reference)``)."""
    if mode == "soft":
        return 1.0 + 1.0 / (1.0 + math.exp(-(r_model - r_reference)))
    if r_model > r_reference:
        return 2.0
    if r_model < r_reference:
        return 1.0
    return 1.5


# --------------------------------------------------------------------------------------------- local judges


class CallableJudge:
    """Wraps ``fn(instruction, output_1, output_2) -> preference``."""

    kind = "callable"

    def __init__(self, fn: Callable[[str, str, str], float], name: Optional[str] = None):
        if not callable(fn):
            raise EvalError(f"judge {fn!r} is not callable.")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__

    def judge_rows(self, rows: Sequence[Dict[str, Any]]) -> List[float]:
        return [
            check_preference(self.fn(r["instruction"], r["output_1"], r["output_2"]), f"judge {self.name} on row {i}")
            for i, r in enumerate(rows)
        ]

    def describe(self) -> Dict[str, Any]:
        return {"kind": self.kind, "name": self.name}


class RewardModelJudge:
    """A sequence-classification reward model (e.g. ArmoRM) scoring each (instruction, output) pair.

    Reward = ``outputs.score`` when the model returns one (ArmoRM's custom head), else ``logits[:, 0]``.
    Text: the reward model's chat template over ``[user: instruction, assistant: output]`` (tokenized
    without extra special tokens), or ``instruction + "\\n\\n" + output`` when it has none; sequences longer
    than ``max_length`` keep their last ``max_length`` tokens. Batches are right-padded.
    """

    kind = "reward_model"

    def __init__(
        self,
        model: Union[str, Any],
        tokenizer=None,
        *,
        mode: str = "hard",
        batch_size: int = 8,
        max_length: int = 4096,
        device: Optional[str] = None,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        name: Optional[str] = None,
    ):
        import torch

        if mode not in RM_MODES:
            raise EvalError(f"reward-model judge mode `{mode}` is not known; use one of {', '.join(RM_MODES)}.")
        self.mode = mode
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        if isinstance(model, str):
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            self.name = name or model
            dtypes = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
            check_model_dir(model, "reward model")  # damaged files, or pickled weights naming code: one paragraph
            try:
                tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
                model = AutoModelForSequenceClassification.from_pretrained(
                    model, dtype=dtypes.get(dtype, "auto"), trust_remote_code=trust_remote_code
                )
            except OSError as exc:
                raise EvalError(f"could not load the reward model `{self.name}` ({exc}). Fix: pass a local directory.")
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            model = model.to(device)
        else:
            self.name = name or type(model).__name__
            if tokenizer is None:
                raise EvalError("RewardModelJudge with a loaded model also needs its tokenizer.")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        self.model = model.eval()
        self.tokenizer = tokenizer

    def encode(self, instruction: str, output: str) -> List[int]:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            messages = [{"role": "user", "content": instruction}, {"role": "assistant", "content": output}]
            text = tok.apply_chat_template(messages, tokenize=False)
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
        else:
            ids = list(tok(instruction + "\n\n" + output)["input_ids"])
        return ids[-self.max_length:]

    def rewards(self, instructions: Sequence[str], outputs: Sequence[str]) -> List[float]:
        import torch

        encoded = [self.encode(i, o) for i, o in zip(instructions, outputs)]
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id
        out: List[float] = []
        with torch.no_grad():
            for b in range(0, len(encoded), self.batch_size):
                chunk = encoded[b : b + self.batch_size]
                T = max(len(x) for x in chunk)
                ids = torch.full((len(chunk), T), int(pad), dtype=torch.long)
                mask = torch.zeros((len(chunk), T), dtype=torch.long)
                for r, x in enumerate(chunk):
                    ids[r, : len(x)] = torch.as_tensor(x)
                    mask[r, : len(x)] = 1
                res = self.model(input_ids=ids.to(device), attention_mask=mask.to(device))
                score = getattr(res, "score", None)
                if score is None:
                    score = res.logits[:, 0] if res.logits.dim() == 2 else res.logits
                out.extend(float(s) for s in score.float().reshape(len(chunk), -1)[:, 0].cpu())
        return out

    def judge_rows(self, rows: Sequence[Dict[str, Any]]) -> List[float]:
        instr = [r["instruction"] for r in rows]
        r1 = self.rewards(instr, [r["output_1"] for r in rows])
        r2 = self.rewards(instr, [r["output_2"] for r in rows])
        self.last_rewards = {"reference": r1, "model": r2}
        return [reward_preference(a, b, self.mode) for a, b in zip(r1, r2)]

    def describe(self) -> Dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "mode": self.mode, "max_length": self.max_length}


class LocalAnnotator:
    """An ``Annotator`` for ``alpaca_eval.main.evaluate(Annotator=...)`` backed by a local judge.

    It receives the reference outputs (``outputs_1``) and the model outputs (``outputs_2``) in the same
    order, asks the judge for a preference per row and returns alpaca_eval annotation records
    (``instruction, output_1, generator_1, output_2, generator_2, annotator, preference``, plus the
    judge's rewards for a reward-model judge).
    """

    def __init__(self, annotators_config=None, judge=None, **kwargs):
        if judge is None:
            raise EvalError("LocalAnnotator needs a judge.")
        self.judge = judge
        self.annotators_config = annotators_config

    def annotate_head2head(self, outputs_1, outputs_2, **kwargs) -> List[Dict[str, Any]]:
        from alpaca_eval import utils

        df1 = utils.convert_to_dataframe(outputs_1).reset_index(drop=True)
        df2 = utils.convert_to_dataframe(outputs_2).reset_index(drop=True)
        if len(df1) != len(df2):
            raise EvalError(f"reference outputs ({len(df1)}) and model outputs ({len(df2)}) differ in length.")
        rows = []
        for i in range(len(df1)):
            a, b = df1.iloc[i], df2.iloc[i]
            if a["instruction"] != b["instruction"]:
                raise EvalError(f"row {i}: reference and model outputs answer different instructions.")
            rows.append(
                {
                    "instruction": a["instruction"],
                    "output_1": a["output"],
                    "generator_1": a.get("generator", "reference"),
                    "output_2": b["output"],
                    "generator_2": b.get("generator", "model"),
                    "dataset": b.get("dataset", a.get("dataset")),
                    "annotator": f"{self.judge.kind}:{self.judge.name}",
                }
            )
        prefs = self.judge.judge_rows(rows)
        rewards = getattr(self.judge, "last_rewards", None) if isinstance(self.judge, RewardModelJudge) else None
        for i, (row, p) in enumerate(zip(rows, prefs)):
            row["preference"] = p
            if rewards is not None:
                row["reward_1"] = rewards["reference"][i]
                row["reward_2"] = rewards["model"][i]
        return rows


# --------------------------------------------------------------------------------------------- API judges


def api_judge_config(name: str, workdir: Union[str, Path]) -> str:
    """The ``annotators_config`` to give alpaca_eval for ``api:NAME``.

    ``weighted_alpaca_eval_gpt-4.1`` (alias ``gpt-4.1``): written to ``workdir/<name>/configs.yaml`` as
    alpaca_eval's ``weighted_alpaca_eval_gpt4_turbo`` config with ``model_name: gpt-4.1`` and the package's
    prompt template by absolute path. An existing file/directory path is returned as is; any other name must
    be one of the package's evaluator configs.
    """
    ae = import_alpaca_eval()
    configs_dir = Path(ae.__file__).parent / "evaluators_configs"
    if name in ("gpt-4.1", DEFAULT_API_JUDGE):
        base = yaml.safe_load((configs_dir / "weighted_alpaca_eval_gpt4_turbo" / "configs.yaml").read_text())
        cfg = dict(base["weighted_alpaca_eval_gpt4_turbo"])
        cfg["prompt_template"] = str((configs_dir / cfg["prompt_template"]).resolve())
        cfg["completions_kwargs"] = dict(cfg["completions_kwargs"], model_name="gpt-4.1")
        out = (Path(workdir) / DEFAULT_API_JUDGE / "configs.yaml").resolve()  # alpaca_eval reads a relative
        out.parent.mkdir(parents=True, exist_ok=True)  # path against its own configs directory
        out.write_text(yaml.safe_dump({DEFAULT_API_JUDGE: cfg}, sort_keys=False))
        return str(out)
    if os.path.exists(name):
        return str(Path(name).resolve())
    if (configs_dir / name).is_dir():
        return name
    known = sorted(p.name for p in configs_dir.iterdir() if p.is_dir())
    from hl_core.errors import did_you_mean

    raise EvalError(
        f"API judge `{name}` is neither a file nor one of alpaca_eval's evaluator configs.{did_you_mean(name, known)} "
        f"Fix: use e.g. `api:{DEFAULT_API_JUDGE}` or `api:weighted_alpaca_eval_gpt4_turbo`."
    )


# --------------------------------------------------------------------------------------------- specs


def load_callable(spec: str) -> Callable:
    """``module.path:function`` or ``path/to/file.py:function``."""
    mod_name, sep, fn_name = spec.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise EvalError(f"callable judge `{spec}`: expected `module:function` or `file.py:function`.")
    try:
        if mod_name.endswith(".py") or os.path.sep in mod_name:
            path = os.path.abspath(mod_name)
            s = importlib.util.spec_from_file_location(Path(path).stem, path)
            if s is None or s.loader is None:
                raise ImportError(path)
            module = importlib.util.module_from_spec(s)
            s.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except (ImportError, FileNotFoundError) as exc:
        raise EvalError(f"callable judge `{spec}`: cannot import `{mod_name}` ({exc}).") from None
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise EvalError(f"callable judge `{spec}`: `{mod_name}` has no `{fn_name}`.")
    return fn


def make_judge(
    judge: Union[str, Callable, Any],
    *,
    workdir: Union[str, Path] = ".",
    rm_mode: str = "hard",
    rm_batch_size: int = 8,
    rm_max_length: int = 4096,
    rm_dtype: str = "auto",
    trust_remote_code: bool = False,
) -> Any:
    """A judge object (``CallableJudge`` / ``RewardModelJudge``) or, for ``api:``, the annotators_config string."""
    if isinstance(judge, (CallableJudge, RewardModelJudge)):
        return judge
    if callable(judge) and not isinstance(judge, str):
        return CallableJudge(judge)
    if not isinstance(judge, str):
        raise EvalError(f"judge {judge!r}: expected a spec string (api:/rm:/py:) or a callable.")
    kind, sep, value = judge.partition(":")
    if not sep or kind not in ("api", "rm", "py"):
        raise EvalError(
            f"judge `{judge}`: expected `api:NAME` (alpaca_eval annotator config), `rm:MODEL` (reward model) or "
            f"`py:MODULE:FUNCTION` (callable)."
        )
    if kind == "api":
        return ApiJudge(api_judge_config(value, workdir), value)
    if kind == "rm":
        return RewardModelJudge(
            value, mode=rm_mode, batch_size=rm_batch_size, max_length=rm_max_length, dtype=rm_dtype,
            trust_remote_code=trust_remote_code,
        )
    return CallableJudge(load_callable(value), name=value)


# alpaca_eval's completion functions -> the environment variables holding their credentials (any one will do)
API_CREDENTIALS = {
    "openai_completions": ("OPENAI_API_KEY", "OPENAI_API_KEYS"),
    "anthropic_completions": ("ANTHROPIC_API_KEY",),
    "google_completions": ("GOOGLE_API_KEY",),
    "cohere_completions": ("COHERE_API_KEY",),
    "huggingface_api_completions": ("HUGGINGFACEHUB_API_TOKEN",),
    "jina_chat_completions": ("JINA_CHAT_API_KEY",),
    "replicate_completions": ("REPLICATE_API_TOKEN",),
}


def _config_file(annotators_config: str) -> Optional[Path]:
    """The configs.yaml that alpaca_eval reads for ``annotators_config`` (a path, or a name of its own configs)."""
    path = Path(annotators_config)
    if not path.exists():
        path = Path(import_alpaca_eval().__file__).parent / "evaluators_configs" / annotators_config
    path = path / "configs.yaml" if path.is_dir() else path
    return path if path.is_file() else None


def missing_credentials(annotators_config: str) -> List[str]:
    """The environment variables, one group per API the annotator config calls, of which none is set (an
    OpenAI client config file, ``OPENAI_CLIENT_CONFIG_PATH`` or alpaca_eval's own, also holds OpenAI keys)."""
    path = _config_file(annotators_config)
    try:
        configs = yaml.safe_load(path.read_text()) if path is not None else None
    except (OSError, yaml.YAMLError):
        configs = None
    functions = sorted({cfg.get("fn_completions") for cfg in (configs or {}).values() if isinstance(cfg, dict)}
                       - {None}) if isinstance(configs, dict) else []
    client_file = Path(os.environ.get("OPENAI_CLIENT_CONFIG_PATH") or
                       Path(import_alpaca_eval().__file__).parent / "client_configs" / "openai_configs.yaml")
    missing = []
    for fn in functions:
        names = API_CREDENTIALS.get(str(fn), ())
        if fn == "openai_completions" and client_file.is_file():
            continue
        if names and not any(os.environ.get(name, "").strip() for name in names):
            missing.append(" or ".join(f"`{name}`" for name in names) + f" (for `{fn}`)")
    return missing


class ApiJudge:
    """An alpaca_eval annotator config (called through the package's PairwiseAnnotator). Its API credentials
    are checked when it is made, before anything is generated."""

    kind = "api"

    def __init__(self, annotators_config: str, name: str):
        self.annotators_config = annotators_config
        self.name = name
        missing = missing_credentials(annotators_config)
        if missing:
            raise EvalError(
                f"AlpacaEval's judge `api:{name}` calls an API whose credentials are not in the environment: "
                f"{'; '.join(missing)} is unset. Nothing was generated. Fix: export the key (e.g. `export "
                "OPENAI_API_KEY=...`), or judge locally with `--judge rm:MODEL` (a reward model) or `--judge "
                "py:MODULE:FUNCTION` (`eval.alpaca_eval.judge` in a recipe)."
            )

    def describe(self) -> Dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "annotators_config": self.annotators_config}
