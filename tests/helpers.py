"""Shared test utilities: launching torchrun, the demo tokenizer/model, synthetic batches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from sft.errors import run_command
from sft.data.masking import IGNORE_INDEX
from sft.training.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO / "configs" / "demo" / "model"
DEMO_MOE_MODEL = REPO / "configs" / "demo_moe" / "model"


# torchrun as the README launches it: SIGUSR1, too, is forwarded to the workers (a stop with a checkpoint).
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]


def run_torchrun(args: list[str], nproc: int, timeout: int = 600, check: bool = True,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc_per_node nproc <args>` from the repo root (CPU, gloo)."""
    cmd = [*TORCHRUN, f"--nproc_per_node={nproc}", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)
    # Any non-zero exit fails, the gloo teardown's abort included (sft.errors.run_command ends a
    # process before the teardown): every 2-rank launch of the suite checks that a finished run exits 0.
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def supervised_spans(labels: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of supervised labels (not IGNORE_INDEX)."""
    out, start = [], None
    for i, label in enumerate(labels + [IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = i
        elif label == IGNORE_INDEX and start is not None:
            out.append((start, i))
            start = None
    return out


def run_cli(main, argv: list[str], capsys) -> tuple[int, str, str]:
    """A command-line entry point run in this process as `python -m sft.<tool> ARGV` runs it
    (through run_command: bad input is one line and exit status 2): (status, stdout, stderr)."""
    try:
        run_command(lambda: main(argv), end_process=False)
    except SystemExit as e:
        status = e.code or 0
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def model_dir(tmp: Path, tied: bool = True, **overrides) -> Path:
    """A copy of the demo model directory (config + tokenizer), optionally untied / reshaped."""
    out = tmp / f"model_{'tied' if tied else 'untied'}{'_' + '_'.join(map(str, overrides.values())) if overrides else ''}"
    if not out.exists():
        shutil.copytree(DEMO_MODEL, out)
        config = json.loads((out / "config.json").read_text())
        if "num_hidden_layers" in overrides:
            config.pop("layer_types", None)  # derived from the depth; transformers recomputes it
        config.update(tie_word_embeddings=tied, **overrides)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def moe_model_dir(tmp: Path, **overrides) -> Path:
    """The MoE demo's tiny Qwen3-MoE config (configs/demo_moe/model) with the demo tokenizer."""
    out = tmp / f"model_moe{'_' + '_'.join(map(str, overrides.values())) if overrides else ''}"
    if not out.exists():
        shutil.copytree(DEMO_MODEL, out)
        config = json.loads((DEMO_MOE_MODEL / "config.json").read_text())
        config.update(overrides)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def gpt_oss_model_dir(tmp: Path) -> Path:
    """A tiny gpt-oss (4 experts, 2 per token, sliding and full attention, a window of 8 tokens: shorter
    than the test rows, so that it binds) with the demo tokenizer."""
    from transformers import GptOssConfig

    out = tmp / "model_gpt_oss"
    if not out.exists():
        shutil.copytree(DEMO_MODEL, out)
        GptOssConfig(vocab_size=899, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=8, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False).save_pretrained(out)
    return out


def synthetic_global_batch(num_samples: int = 8, vocab: int = 800, seed: int = 0) -> list[dict]:
    """Samples of uneven lengths with uneven numbers of supervised tokens (labels unshifted)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num_samples):
        length = int(torch.randint(12, 48, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g)
        start = int(torch.randint(1, length - 2, (1,), generator=g))
        end = int(torch.randint(start + 1, length + 1, (1,), generator=g))
        labels = torch.full((length,), -100)
        labels[start:end] = ids[start:end]
        samples.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return samples


def with_test_hooks(**variables: str) -> dict[str, str]:
    """Environment that loads tests/slow_hooks/sitecustomize.py (test-only slow saves, slow
    tokenisation, a full disk on one rank) with the given SFT_TEST_* variables."""
    path = os.pathsep.join([str(REPO / "tests" / "slow_hooks"), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, **variables}


def start_in_background(args: list[str], nproc: int | None, env: dict | None = None,
                        new_session: bool = False) -> subprocess.Popen:
    """Start `train.py ...` args under torchrun with `nproc` ranks (or as plain python when None),
    without waiting, for tests that signal or race a running run (`new_session`: in a process
    group of its own, as a terminal or a supervisor would start it)."""
    launcher = [sys.executable] if nproc is None else [*TORCHRUN, f"--nproc_per_node={nproc}"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.Popen([*launcher, *args], cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=new_session)


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 240) -> None:
    """Wait until the running `proc` has logged optimizer step `step` to run_dir/metrics.jsonl."""
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + timeout
    while not (metrics.exists() and f'"step": {step},' in metrics.read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)


def demo_args(data: Path, out: Path, name: str, *overrides: str, config: str = "configs/demo.yaml") -> list[str]:
    """train.py arguments for the demo config (or `config`) on `data` (train.jsonl + eval.jsonl), run
    `name` under `out`; later overrides win."""
    return ["train.py", "--config", config, f"data.path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'eval.jsonl'}", f"train.output_dir={out}", f"train.run_name={name}",
            f"data.cache_dir={out / 'cache'}", *overrides]


def run_demo(data: Path, out: Path, name: str, *overrides: str, nproc: int = 1, config: str = "configs/demo.yaml",
             **kwargs) -> subprocess.CompletedProcess:
    """The one launcher of train.py runs in the tests: torchrun on the demo config (see demo_args)."""
    return run_torchrun(demo_args(data, out, name, *overrides, config=config), nproc=nproc, **kwargs)


def train_losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad norm) of a run's metrics.jsonl."""
    steps, _ = read_metrics(run_dir)
    return {step: (m["loss"], m["grad_norm"]) for step, m in steps.items()}


def one_entry_per_step(run: Path) -> bool:
    """metrics.jsonl holds each step's training entry once and each evaluation once, in step order,
    however often the run was resumed."""
    entries = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = [(e["step"], "eval_loss" in e) for e in entries]
    trained = [step for step, is_eval in keys if not is_eval]
    return len(keys) == len(set(keys)) and trained == sorted(trained)


def eval_losses(run_dir: Path) -> list[float]:
    _, evals = read_metrics(run_dir)
    return [evals[step] for step in sorted(evals)]


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run inside it, by name (e.g. what a checkpointed block recomputes)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def file_tree(root: Path) -> dict[str, bytes]:
    """Every file under `root`, by relative path, with its bytes: what a tool must leave as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def compiled_demo_config(tmp_path: Path) -> Path:
    """A config file of the demo model with compile on (what float8 needs) and a stand-in data file."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": []}\n')
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "configs/demo/model"}, "data": {"path": str(data)},
                                    "compile": {"enabled": True}}))
    return path


def hf_moe_model(path: Path = DEMO_MOE_MODEL, seed: int = 0, **overrides):
    """transformers' own MoE model of `path`'s config (the MoE demo's), seeded, with eager experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(path, **overrides)
    config.use_cache = False
    return AutoModelForCausalLM.from_config(config, experts_implementation="eager")


def gated_deltanet_model_dir(tmp: Path) -> Path:
    """A tiny Qwen3.5 text model (Gated DeltaNet layers, then full attention: transformers' own
    config class) with the demo tokenizer."""
    from transformers import AutoConfig

    out = tmp / "model_qwen3_5"
    if not out.exists():
        shutil.copytree(DEMO_MODEL, out)
        AutoConfig.for_model("qwen3_5_text", vocab_size=899, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             eos_token_id=2, pad_token_id=0).save_pretrained(out)
    return out


def short_convolution_model_dir(tmp: Path) -> Path:
    """A tiny LFM2 model (short convolution layers between attention layers: transformers' own config
    class) with the demo tokenizer."""
    from transformers import AutoConfig

    out = tmp / "model_lfm2"
    if not out.exists():
        shutil.copytree(DEMO_MODEL, out)
        AutoConfig.for_model("lfm2", vocab_size=899, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, pad_token_id=0,
                             layer_types=["conv", "full_attention", "conv", "full_attention"],
                             tie_word_embeddings=False).save_pretrained(out)
    return out



# Tiny vision-language checkpoints as transformers saves them (the language model's config as the
# demo's where the family allows), each family with its text and vision configs.
_TINY_TEXT = dict(vocab_size=899, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, eos_token_id=2, pad_token_id=0)
VISION_LANGUAGE = {
    # Qwen3.5: Gated DeltaNet and attention layers; files under model.language_model. (transformers 5)
    "qwen3_5": dict(text_config=dict(_TINY_TEXT, layer_types=["linear_attention", "full_attention"]),
                    vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)),
    # Gemma-3: tied, sliding and global attention; files under language_model.model. (as published)
    "gemma3": dict(text_config=dict(_TINY_TEXT, layer_types=["sliding_attention", "full_attention"]),
                   vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=28, patch_size=14), mm_tokens_per_image=4),
    # Qwen3.5-MoE: experts, a gated shared expert and Gated DeltaNet, under a vision tower
    "qwen3_5_moe": dict(text_config=dict(_TINY_TEXT, layer_types=["linear_attention", "full_attention"],
                                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32),
                        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                           out_hidden_size=64)),
    # Qwen3-VL: a Qwen3 language model with interleaved multimodal rotary positions
    "qwen3_vl": dict(text_config=dict(_TINY_TEXT, rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3],
                                                                        mrope_interleaved=True, rope_theta=10000.0)),
                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                        deepstack_visual_indexes=[0])),
    # Qwen3-VL-MoE: its text model with routed experts in every block (Qwen3-VL-30B-A3B, -235B-A22B)
    "qwen3_vl_moe": dict(text_config=dict(_TINY_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          decoder_sparse_step=1,
                                          rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3],
                                                               mrope_interleaved=True, rope_theta=10000.0)),
                         vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                            out_hidden_size=64, deepstack_visual_indexes=[0])),
    # Qwen2.5-VL: the same kind of text model (multimodal rotary sections), a windowed vision tower
    "qwen2_5_vl": dict(text_config=dict(_TINY_TEXT, rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3],
                                                                          rope_theta=10000.0)),
                       vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                          out_hidden_size=64, fullatt_block_indexes=[0])),
    # GLM-4.1V: a dense text model with partial multimodal rotary
    "glm4v": dict(text_config=dict(_TINY_TEXT, rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2],
                                                                     rope_theta=10000.0, partial_rotary_factor=0.5)),
                  vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)),
    # GLM-4.5V: DeepSeek-style routed and shared experts; its files hold one tensor per expert, which
    # transformers merges by the vision-language class's conversions (its text model has none)
    "glm4v_moe": dict(text_config=dict(_TINY_TEXT, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=0,
                                       n_shared_experts=1, moe_intermediate_size=32,
                                       rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2],
                                                            rope_theta=10000.0, partial_rotary_factor=0.5)),
                      vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)),
    # Llama-4: mixture-of-experts blocks between dense ones, chunked attention
    "llama4": dict(text_config=dict(_TINY_TEXT, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
                                    interleave_moe_layer_step=2, attention_chunk_size=64),
                   vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                                      projector_output_dim=64)),
    # Gemma-4: per-layer inputs, sliding and global attention of their own head widths, a vision tower
    "gemma4": dict(text_config=dict(_TINY_TEXT, layer_types=["sliding_attention", "full_attention"],
                                    vocab_size_per_layer_input=899, hidden_size_per_layer_input=16, per_layer_config={},
                                    global_head_dim=16),
                   vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, head_dim=16)),
    # Mistral-3: a Mistral language model (files as published: language_model.model.)
    "mistral3": dict(text_config=dict(_TINY_TEXT, model_type="mistral"),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                        head_dim=16, image_size=28, patch_size=14)),
}


def vision_language_model_dir(tmp: Path, model_type: str) -> Path:
    """A tiny vision-language checkpoint of `model_type` (random weights, saved by transformers as
    its ForConditionalGeneration class) with the demo tokenizer."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    out = tmp / f"model_{model_type}_vl"
    if not out.exists():
        shutil.copytree(DEMO_MODEL, out)
        (out / "config.json").unlink()
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, **VISION_LANGUAGE[model_type])
        AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    return out


def image_model_dir(tmp: Path, model_type: str) -> Path:
    """A tiny vision-language checkpoint of `model_type` that takes images: the vision-language demo's
    tokenizer (Qwen's image tokens), chat template and image processor (configs/demo_vlm/model) and
    the family's tiny random weights (VISION_LANGUAGE)."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    out = tmp / f"model_{model_type}_images"
    if out.exists():
        return out
    shutil.copytree(REPO / "configs" / "demo_vlm" / "model", out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = {key: json.loads((out / "config.json").read_text())[key]
           for key in ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")}
    spec = VISION_LANGUAGE[model_type]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**spec, "text_config": {**spec["text_config"], "vocab_size": len(tokenizer)},
                                                 **ids})
    (out / "config.json").unlink()
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    processor = json.loads((out / "preprocessor_config.json").read_text())  # the tower's patches (GLM's are 14 pixels)
    processor["patch_size"] = config.vision_config.patch_size
    (out / "preprocessor_config.json").write_text(json.dumps(processor))
    return out


# A tiny random model of any architecture transformers ships, from its own config class: the keys
# every family knows plus the mixture-of-experts, multi-head-latent and linear-attention ones
# (a config class sets the keys it does not use as plain attributes).
TINY = dict(vocab_size=899, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=2, pad_token_id=0, bos_token_id=1,
            num_experts=8, num_local_experts=8, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, n_shared_experts=1, shared_expert_intermediate_size=32,
            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            tie_word_embeddings=False, max_position_embeddings=512)


# Falcon-H1's Mamba-2 mixer at the tiny widths (a hybrid whose state is not restarted per document)
FALCON_H1 = dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16)


def tiny_config(model_type: str, **overrides):
    """transformers' own config class of `model_type`, tiny (TINY, then `overrides`), no KV cache."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    config.use_cache = False
    return config


def hf_eval_loss(model, data: Path, model_dir: Path) -> float:
    """transformers' own loss of `model` on the demo's eval set (`data`/eval.jsonl, tokenised with
    `model_dir`'s tokenizer), averaged over supervised tokens: what a demo run's eval reports."""
    from sft.config import ModelConfig, load_config
    from sft.data.collate import collate
    from sft.data.prepare import load_sft_data
    from sft.hub.tokenizer import load_tokenizer

    cfg = load_config(REPO / "configs" / "demo.yaml", [f"data.path={data / 'train.jsonl'}",
                                                       f"data.eval_path={data / 'eval.jsonl'}"])
    _, evals = load_sft_data(cfg.data, load_tokenizer(ModelConfig(name_or_path=str(model_dir))), seed=0)
    ce, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(evals), 8):
            batch = collate([evals[i] for i in range(start, min(start + 8, len(evals)))], 0, 256)
            n = int((batch["labels"][:, 1:] != -100).sum())
            ce += model(**batch, use_cache=False).loss.item() * n
            count += n
    return ce / count


def saved_model_dir(tmp: Path, model_type: str, **overrides) -> Path:
    """A tiny random `model_type` model (tiny_config) saved by transformers, as a hub checkpoint is
    laid out (MoE experts one tensor per expert), with the demo tokenizer; correction biases and
    expert biases off zero, so that loading them is seen."""
    from transformers import AutoModelForCausalLM

    out = tmp / f"saved_{model_type}"
    if not out.exists():
        shutil.copytree(DEMO_MODEL, out)
        (out / "config.json").unlink()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
        with torch.no_grad():
            for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
                if name.endswith("e_score_correction_bias") or (name.endswith("_bias") and "experts" in name):
                    tensor.uniform_(-0.5, 0.5)
        model.save_pretrained(out)
    return out


def tiny_model_dir(tmp: Path, model_type: str, **overrides) -> Path:
    """A directory with a tiny `model_type` config.json (tiny_config; no weights: model.init=random)
    and the demo tokenizer."""
    out = tmp / f"tiny_{model_type}"
    if not out.exists():
        shutil.copytree(DEMO_MODEL, out)
        tiny_config(model_type, **overrides).save_pretrained(out)
    return out
