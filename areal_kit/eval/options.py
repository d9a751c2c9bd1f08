"""What `areal-kit eval` and `areal-kit filter` are told: EvalConfig and FilterConfig, checked.

Each field that is a command-line option carries its flag, default and help (areal_kit/flags.py),
and eval/cmd.py makes the commands' signatures of them: an option is written once. The engine
options both commands have (--seed, --tp, --num_engines) are Engines', which both configs extend;
the others both have (the checkpoint, the output folder, the sampling) are Generation's, declared
without a default: each config holds its command's.
Nothing heavy is imported here: `areal-kit --help` reads these fields.

    cfg = EvalConfig(model_path="ckpt", output_path="out", data_names=["math_500"], num_samples=8)
"""

# flag() returns dataclasses.field(...); ruff's RUF009 knows only field() by name.
# ruff: noqa: RUF009

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from areal_kit import adapters
from areal_kit.config.dataset import DatasetConfig
from areal_kit.errors import UserError
from areal_kit.flags import flag

DATA_NAMES = ("math_500", "aime24", "amc23")  # eval's default datasets
NUM_SAMPLES = 32  # eval's sampled answers per question when no flag says how many
GUIDE_RUNS = (8, 4)  # the AReaL guide's sampling runs and answers per run, where one of the two is given
TYPES = ("areal", "jsonl", "hf")  # the dataset formats filter reads
_RANGE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*-\s*(\d+(?:\.\d*)?|\.\d+)\s*")


def _refuse(checks: list[tuple[bool, str]]) -> None:
    """UserError with the message of the first check that fails."""
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)


@dataclass(kw_only=True)
class Engines:
    """The vLLM engines' options that eval and filter share; generate() (eval/evaluation.py) reads them."""

    seed: int = flag(0, "--seed", help="Base seed; each sample's seed derives from it.")
    tp: int = flag(1, "--tp", help="Tensor-parallel GPUs per vLLM engine.")
    num_engines: int = flag(0, "--num_engines", "--num-engines",
                            help="Data-parallel vLLM engines (0: GPUs // tp; 1 on CPU).")
    chunk_size: int = 256  # requests per engine between two record flushes

    def engine_checks(self) -> list[tuple[bool, str]]:
        return [(self.tp >= 1 and self.num_engines >= 0, "tp must be >= 1 and num_engines >= 0"),
                (self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}")]


@dataclass
class EvalConfig(Engines):
    """Everything one `areal-kit eval` run needs (one checkpoint: the command's --model_path may
    name several, each evaluated with a config of its own)."""

    model_path: str  # Hugging Face model folder (config.json, weights, tokenizer)
    output_path: str  # folder for records, aggregate and table
    data_names: list[str] = field(default_factory=lambda: list(DATA_NAMES))
    data_dir: str = "evaluation/data"  # folder of <name>/test.jsonl
    prompt_type: str = flag("deepscaler", "--prompt_type", "--prompt-type",
                            help="Prompt template from evaluation/prompts.yaml.")
    # --max_gen_tokens, --num_samples, --temperature and --top_p are Generation's (filter takes them too).
    max_gen_tokens: int = 32768
    # Sampled generations per question (0: greedy only): None until __post_init__ works it out
    # from these four (sample_count).
    num_samples: int | None = None
    n_sampling: int | None = flag(None, "--n_sampling", "--n-sampling",
                                  help="The AReaL guide's name for --num_samples (with --num_sample_nodes: "
                                       "at most their product, as there).")
    num_sample_nodes: int | None = flag(None, "--num_sample_nodes", "--num-sample-nodes",
                                        help="The guide's sampling runs: N runs of --samples_per_node "
                                             "answers there are N x M sampled answers per question here, "
                                             f"each with its own seed, spread over the engines (default {GUIDE_RUNS[0]}).")
    samples_per_node: int | None = flag(None, "--samples_per_node", "--samples-per-node",
                                        help="The guide's answers per sampling run (see --num_sample_nodes; "
                                             f"default {GUIDE_RUNS[1]}).")
    temperature: float = 0.6
    top_p: float = 0.95
    greedy: bool = flag(True, "--greedy/--no_greedy", help="Also make one temperature-0 generation per question.")
    max_questions: int = flag(0, "--max_questions", "--max-questions",
                              help="Evaluate only the first N questions of each dataset (0: all).")
    grade_timeout_s: float = flag(5.0, "--grade_timeout", "--grade-timeout",
                                  help="Seconds math-verify may spend on one answer.")
    enforce_eager: bool = flag(True, "--enforce_eager/--no_enforce_eager", "--enforce-eager/--no-enforce-eager",
                               help="Run vLLM eager, without CUDA graphs, as the guide's numbers were "
                                    "made (--no_enforce_eager: faster, may round differently).")
    overwrite: bool = flag(False, "--overwrite",
                           help="Delete the records of an earlier evaluation in --output_path and "
                                "evaluate from scratch (without it a re-run resumes).")

    def __post_init__(self) -> None:
        self.num_samples = sample_count(self.num_samples, self.n_sampling, self.num_sample_nodes,
                                        self.samples_per_node)
        if not self.greedy and self.num_samples <= 0:
            raise UserError("nothing to evaluate: greedy is off and num_samples is 0; "
                            "expected --greedy or --num_samples >= 1")
        _refuse([
            (self.max_gen_tokens >= 1, f"max_gen_tokens must be >= 1, got {self.max_gen_tokens}"),
            (self.num_samples >= 0, f"num_samples must be >= 0, got {self.num_samples}"),
            (self.temperature > 0 or self.num_samples == 0,
             f"temperature must be > 0 for sampled generations, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.max_questions >= 0, f"max_questions must be >= 0, got {self.max_questions}"),
            (self.grade_timeout_s > 0, f"grade_timeout_s must be > 0, got {self.grade_timeout_s}"),
            *self.engine_checks(),
        ])
        from areal_kit.eval import data as evdata  # the prompts' templates; it brings the grader along

        evdata.template_for(self.prompt_type)
        check_model_path(self.model_path)

    def identity(self) -> dict:
        """The settings a stored sample depends on; must match to reuse earlier records."""
        return {"model_path": str(Path(self.model_path).resolve()), "prompt_type": self.prompt_type,
                "max_gen_tokens": self.max_gen_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "seed": self.seed}


def sample_count(num_samples: int | None, n_sampling: int | None, nodes: int | None, per_node: int | None) -> int:
    """Sampled answers per question, from --num_samples (NUM_SAMPLES by default) or the AReaL guide's
    flags. --n_sampling is AReaL's name for --num_samples. AReaL's --num_sample_nodes N runs of
    --samples_per_node M answers (GUIDE_RUNS by default) are N x M answers here, each with its own
    seed, shared by the engines; as in AReaL, --n_sampling may not exceed N x M."""
    if nodes is None and per_node is None:
        if None not in (num_samples, n_sampling) and num_samples != n_sampling:
            raise UserError(f"--num_samples {num_samples} and --n_sampling {n_sampling} disagree; --n_sampling "
                            "is AReaL's name for --num_samples: give one of them")
        return next((n for n in (num_samples, n_sampling) if n is not None), NUM_SAMPLES)
    nodes, per_node = GUIDE_RUNS[0] if nodes is None else nodes, GUIDE_RUNS[1] if per_node is None else per_node
    if nodes < 1 or per_node < 1:
        raise UserError(f"--num_sample_nodes {nodes} x --samples_per_node {per_node} is not valid; expected "
                        "both >= 1 (their product is the sampled answers per question)")
    total = nodes * per_node
    if num_samples is not None and num_samples != total:
        raise UserError(f"--num_samples {num_samples} is not --num_sample_nodes {nodes} x --samples_per_node "
                        f"{per_node} = {total}; give one of them")
    if n_sampling is not None and n_sampling > total:
        raise UserError(f"--n_sampling {n_sampling} is more than --num_sample_nodes {nodes} x --samples_per_node "
                        f"{per_node} = {total} sampled answers; expected at most {total}")
    return total


def check_model_path(model_path: str) -> None:
    """UserError unless model_path is a Hugging Face model folder (eval's and filter's check)."""
    mp = Path(model_path)
    if not mp.is_dir():
        raise UserError(f"model path {model_path} not found; expected a Hugging Face "
                        "model folder (config.json, weights, tokenizer)")
    if (mp / "adapter_config.json").exists():  # a LoRA adapter: its base must be a model folder
        adapters.adapter_base(model_path)
    elif not (mp / "config.json").exists():
        raise UserError(f"model path {model_path} has no config.json; expected a "
                        "Hugging Face model folder (a checkpoint saved by areal-kit train is one)")


def parse_keep(text: str) -> tuple[float, float]:
    """'0.1-0.9' -> (0.1, 0.9): an inclusive range of pass rates, 0 <= LO <= HI <= 1."""
    m = _RANGE.fullmatch(text)
    expect = "expected LO-HI with 0 <= LO <= HI <= 1, e.g. --keep 0.1-0.9"
    if not m:
        raise UserError(f"--keep {text!r} is not a range; {expect}")
    lo, hi = float(m[1]), float(m[2])
    if hi > 1:
        raise UserError(f"--keep {text!r}: pass rates are at most 1; {expect}")
    if lo > hi:
        raise UserError(f"--keep {text!r}: LO {lo:g} is above HI {hi:g}; {expect}")
    return lo, hi


@dataclass
class FilterConfig(Engines):
    """Everything one `areal-kit filter` run needs; its fields in the order `--help` lists them."""

    # --model_path, --output_path, --num_samples, --max_gen_tokens, --temperature and --top_p are
    # Generation's (eval takes them too); the defaults here are filter's.
    model_path: str
    dataset: str = flag(..., "--dataset",
                        help="Training dataset to filter: a jsonl file (--type jsonl, areal) or a "
                             "datasets folder (--type hf), read as training reads dataset.path.")
    type: str = flag("jsonl", "--type", help="Dataset format: jsonl | areal | hf (as dataset.type).")
    question_field: str = flag("question", "--question_field", "--question-field",
                               help="jsonl/hf: field holding the question.")
    answer_field: str = flag("answer", "--answer_field", "--answer-field",
                             help="jsonl/hf: field holding the reference answer.")
    id2info_path: str = flag("", "--id2info_path", "--id2info-path",
                             help="areal: id2info.json (default: beside the dataset).")
    output_path: str = "filter_out"
    num_samples: int = 8  # pass rate = correct / num_samples
    # Pass rates kept, ends included, as written (LO-HI); keep_range is the pair.
    keep: str = flag("0.1-0.9", "--keep",
                     help="Pass rates kept, LO-HI, ends included (0.1-0.9 drops prompts solved by "
                          "fewer than 10% or more than 90% of the samples).")
    max_gen_tokens: int = 16384  # as ppo.gen.max_new_tokens
    temperature: float = 0.6  # as ppo.gen.temperature
    top_p: float = 1.0  # as ppo.gen.top_p
    apply_chat_template: bool = flag(False, "--apply_chat_template", "--apply-chat-template",
                                     help="Apply the tokenizer's chat template to prompts "
                                          "(as dataset.apply_chat_template).")
    max_prompt_len: int = flag(2048, "--max_prompt_len", "--max-prompt-len",
                               help="Prompts longer than this (tokens) are not sampled nor kept, as "
                                    "training drops them (dataset.max_prompt_len).")
    enforce_eager: bool = False  # CUDA graphs: its pass rates are a filter, not numbers to compare

    def __post_init__(self) -> None:
        self.keep_range = parse_keep(self.keep)
        if self.type not in TYPES:
            raise UserError(f"--type {self.type!r} is not a dataset file format; expected one of {', '.join(TYPES)} "
                            "(the toy task is generated, there is nothing to filter)")
        _refuse([
            (self.num_samples >= 1, f"num_samples must be >= 1, got {self.num_samples}"),
            (self.max_gen_tokens >= 1, f"max_gen_tokens must be >= 1, got {self.max_gen_tokens}"),
            (self.temperature > 0, f"temperature must be > 0 for sampled completions, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.max_prompt_len >= 1, f"max_prompt_len must be >= 1, got {self.max_prompt_len}"),
            *self.engine_checks(),
        ])
        check_model_path(self.model_path)
        _check_output_apart(self)

    def dataset_config(self) -> DatasetConfig:
        return DatasetConfig(path=self.dataset, type=self.type, id2info_path=self.id2info_path,
                             question_field=self.question_field, answer_field=self.answer_field)

    def id2info_file(self) -> Path:
        """Where training reads this areal dataset's id2info.json from."""
        return Path(self.id2info_path or os.path.join(os.path.dirname(os.path.abspath(self.dataset)), "id2info.json"))

    def identity(self, digest: str) -> dict:
        """The settings a stored sample depends on; num_samples and keep are not among them (a
        sample's seed depends on its index, not on how many there are)."""
        return {"command": "filter", "model_path": str(Path(self.model_path).resolve()),
                "dataset": str(Path(self.dataset).resolve()), "type": self.type, "dataset_sha256": digest,
                "apply_chat_template": self.apply_chat_template, "max_gen_tokens": self.max_gen_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}


def _check_output_apart(cfg: FilterConfig) -> None:
    # filtered.jsonl and id2info.json written into the dataset's own folder would replace its files,
    # and anywhere inside a datasets folder they would be read as more of its data files.
    out = Path(cfg.output_path).resolve()
    data = Path(cfg.dataset).resolve()
    homes = [data.parent] + ([cfg.id2info_file().resolve().parent] if cfg.type == "areal" else [])
    if out in homes or (cfg.type == "hf" and (out == data or data in out.parents)):
        raise UserError(f"--output_path {cfg.output_path} is the dataset's folder; expected another folder "
                        "(filter writes filtered.jsonl and id2info.json there)")


EVAL_OUT = "eval_out"  # eval's --output_path when none is given


@dataclass
class Generation:
    """The options eval and filter both take: the checkpoint that generates, where its records go, how
    it samples. None: not given, the command's default (EvalConfig's, FilterConfig's)."""

    model_path: list[str] = flag(..., "--model_path", "--model-path",
                                 help="Hugging Face model folder (a checkpoint): the one eval evaluates, or whose "
                                      "pass rates filter keeps prompts by. eval: repeat it, or give a folder of "
                                      "checkpoints (a run's checkpoints/.../actor), to evaluate each into "
                                      "OUT/<name> and compare them in OUT/compare.md.")
    output_path: str | None = flag(None, "--output_path", "--output-path",
                                   help=f"Folder for eval's per-sample records, aggregate.json and the table "
                                        f"(default {EVAL_OUT}), or filter's samples.jsonl, rates.jsonl and "
                                        f"filtered.jsonl (default {FilterConfig.output_path}); a re-run with the "
                                        f"same folder resumes.")
    num_samples: int | None = flag(None, "--num_samples", "--num-samples",
                                   help=f"Sampled generations per question. eval: 0 is greedy only, default "
                                        f"{NUM_SAMPLES}; pass@k is reported for k in 1, 8, 16 up to this. filter: "
                                        f"default {FilterConfig.num_samples}; pass rate = correct / num_samples.")
    max_gen_tokens: int | None = flag(None, "--max_gen_tokens", "--max-gen-tokens",
                                      help=f"Maximum generated tokens per sample (default: eval "
                                           f"{EvalConfig.max_gen_tokens}; filter {FilterConfig.max_gen_tokens}, as "
                                           f"ppo.gen.max_new_tokens).")
    temperature: float | None = flag(None, "--temperature",
                                     help=f"Temperature of sampled generations (default: eval "
                                          f"{EvalConfig.temperature:g}; filter {FilterConfig.temperature:g}, as "
                                          f"ppo.gen.temperature).")
    top_p: float | None = flag(None, "--top_p", "--top-p",
                               help=f"Top-p of sampled generations (default: eval {EvalConfig.top_p:g}; filter "
                                    f"{FilterConfig.top_p:g}, as ppo.gen.top_p).")
