"""Config: typed tree, YAML + dotted overrides, one clear error before anything is created."""

import importlib
from pathlib import Path

import pytest
import yaml

from helpers import REPO, run_cli
from sft.config import ConfigError, load_config, to_yaml
from sft.config.reference import README_MARKERS, reference_markdown


def write(tmp_path: Path, tree: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def base(tmp_path: Path) -> dict:
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": []}\n')
    return {"model": {"name_or_path": "configs/demo/model"}, "data": {"path": str(data)}}


def test_overrides_beat_yaml_and_parse_numbers(tmp_path):
    tree = base(tmp_path)
    tree["optim"] = {"lr": "1e-5"}  # YAML 1.1 reads 1e-5 as a string
    cfg = load_config(write(tmp_path, tree), ["ac.ratio=0.5", "optim.lr=2e-5", "train.max_steps=7"])
    assert cfg.ac.ratio == 0.5 and cfg.optim.lr == 2e-5 and cfg.train.max_steps == 7
    assert load_config(write(tmp_path, tree)).optim.lr == 1e-5


@pytest.mark.parametrize("override, message", [
    ("ac.ratio=1.5", "ac.ratio=1.5: must be in [0, 1]"),
    ("ac.offload=true", "ac.offload=True: keeps the checkpointed blocks' inputs in host memory: set ac.ratio > 0"),
    ("ac.mlp_tile_tokens=-1", "ac.mlp_tile_tokens=-1: must be >= 0 (0 = off)"),
    ("optim.lr=0", "optim.lr=0.0: must be > 0"),
    ("optim.lr=inf", "optim.lr='inf': expected a finite number"),
    ("optim.eps=nan", "optim.eps='nan': expected a finite number"),
    ("train.grad_accum_steps=0", "train.grad_accum_steps=0: must be >= 1"),
    ("optim.lrr=1", "optim.lrr: unknown key (valid keys in optim: lr,"),
    ("foo.bar=1", "foo: unknown key"),
    ("train.micro_batch_size=two", "train.micro_batch_size='two': expected an integer"),
    ("compile.enabled=3", "compile.enabled=3: expected true or false"),
    ("data.train_on=everything", "expected one of ['all_assistant', 'last_assistant']"),
    ("data.path=missing.jsonl", "data.path='missing.jsonl': file not found"),
    ("data.chat_template_kwargs=true", "data.chat_template_kwargs=True: expected a mapping of names to values"),
    ("data.chat_template_kwargs.tools=[]", "data.chat_template_kwargs={'tools': []}: tools are set by the trainer"),
    ("data.chat_template_kwargs={a: 1", "override 'data.chat_template_kwargs={a: 1': the value is not valid YAML"),
    ("lora.rank=-1", "lora.rank=-1: must be >= 0 (0 = full fine-tuning)"),
    (["lora.rank=8", "lora.dropout=1"], "lora.dropout=1.0: must be in [0, 1)"),
    (["lora.rank=8", "lora.target_modules=[]"], "lora.target_modules=[]: name at least one Linear layer"),
    (["lora.rank=8", "lora.base=nf4", "precision.float8=tensorwise", "compile.enabled=true"],
     "precision.float8='tensorwise': not with lora.base='nf4'"),
    (["lora.rank=8", "lora.base=nf4", "fsdp.cpu_offload=true"], "lora.base='nf4': not with fsdp.cpu_offload=true"),
    (["lora.rank=8", "lora.base=nf4", "model.prepared_cache=/tmp/cache"], "lora.base='nf4': not with model.prepared_cache"),
    (["lora.rank=8", "lora.base=nf8"], "lora.base"),
    ("lora.base=nf4", "lora.base='nf4': the frozen base of LoRA, and lora.rank=0 trains every parameter (full "
                      "fine-tuning); set lora.rank > 0 for QLoRA"),
    ("plan.allow_lean_state=true", "plan.allow_lean_state=True: lets plan.auto choose bfloat16 optimizer state, and "
                                   "does nothing without it: set plan.auto=true"),
    ("moe.ep_degree=0", "moe.ep_degree=0: must be >= 1 (1 = no expert parallelism)"),
    (["optim.master_dtype=bfloat16"], "bfloat16 master weights need fsdp.param_dtype=bfloat16 and "
                                      "fsdp.reduce_dtype=bfloat16"),
    (["optim.master_dtype=bfloat16", "fsdp.param_dtype=bfloat16", "fsdp.reduce_dtype=bfloat16",
      "fsdp.replicate_degree=2"], "fsdp.replicate_degree > 1 (each replica would round its copy apart)"),
    (["optim.state_dtype=bfloat16", "fsdp.cpu_offload=true"], "bfloat16 moments do not combine with fsdp.cpu_offload"),
    (["moe.ep_degree=2", "fsdp.replicate_degree=2"], "expert parallelism does not combine with "
                                                     "fsdp.replicate_degree > 1 or QLoRA's lora.base=nf4"),
    (["moe.ep_degree=2", "lora.rank=8", "lora.base=nf4"], "moe.ep_degree=2: expert parallelism does not combine"),
    ("model.attn_implementation=sdap", "model.attn_implementation='sdap': not an attention implementation "
                                       "transformers knows (one of eager, flash_attention_2,"),
    ("model.attn_implementation=flash_attention_2", "model.attn_implementation='flash_attention_2': needs the "
                                                    "flash_attn package, which is not installed here"),
])
def test_bad_values_name_key_and_file(tmp_path, override, message):
    path = write(tmp_path, base(tmp_path))
    with pytest.raises(ConfigError) as err:
        load_config(path, [override] if isinstance(override, str) else override)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_missing_required_keys_are_all_reported(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, {"train": {"epochs": 1}}))
    assert "model.name_or_path" in str(err.value) and "data.path" in str(err.value)


def test_chat_template_kwargs_from_yaml_and_overrides(tmp_path):
    tree = base(tmp_path)
    tree["data"]["chat_template_kwargs"] = {"enable_thinking": True, "reasoning_effort": "low"}
    cfg = load_config(write(tmp_path, tree), ["data.chat_template_kwargs.enable_thinking=false"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(write(tmp_path, base(tmp_path)), ["optim.betas=[0.9, 0.99]", "data.chat_template_kwargs.x=1"])
    again = write(tmp_path, yaml.safe_load(to_yaml(cfg)))
    assert load_config(again) == cfg


def test_readme_config_reference_is_current():
    """`python -m sft.config --readme docs/configuration.md` regenerates it; this fails until someone does."""
    readme = (REPO / "docs" / "configuration.md").read_text()
    start, end = README_MARKERS
    assert readme.split(start)[1].split(end)[0] == reference_markdown()


def test_reference_documents_every_key():
    ref = reference_markdown()
    for key in ("model.name_or_path", "ac.ratio", "optim.lr", "data.train_on", "fsdp.reduce_dtype"):
        assert f"`{key}`" in ref
    assert "| |" not in ref.replace("| | ", "")  # every row has a description


def test_train_py_fails_before_creating_anything(tmp_path, capsys):
    import train

    tree = base(tmp_path)
    tree["train"] = {"output_dir": str(tmp_path / "runs")}
    status, _, err = run_cli(train.main, ["--config", str(write(tmp_path, tree)), "ac.ratio=2"], capsys)
    assert status == 2
    assert "ac.ratio=2.0: must be in [0, 1]" in err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("path", sorted((REPO / "configs").rglob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path, tmp_path, monkeypatch):
    """Every shipped config loads; data files that `make demo` / the bench scripts generate are
    stood in for by an empty file (only their existence is checked at parse time)."""
    monkeypatch.chdir(REPO)
    tree = yaml.safe_load(path.read_text())
    overrides = []
    for key in ("path", "eval_path"):
        value = tree["data"].get(key)
        if value and value.startswith("data/") and not (REPO / value).exists():
            (tmp_path / Path(value).name).touch()
            overrides.append(f"data.{key}={tmp_path / Path(value).name}")
    cfg = load_config(path, overrides)
    assert cfg.model.name_or_path and cfg.data.path


@pytest.mark.parametrize("key, value", [("name_or_path", "./no/such/model"), ("tokenizer", "/no/such/tokenizer")])
def test_a_missing_model_directory_names_its_key(key, value):
    from sft.config import ModelConfig
    from sft.models.build import ModelError
    from sft.hub.tokenizer import load_tokenizer

    cfg = ModelConfig(**{"name_or_path": str(REPO / "configs" / "demo" / "model"), key: value})
    with pytest.raises(ModelError) as err:
        load_tokenizer(cfg)
    assert str(err.value).startswith(f"model.{key}='{value}': no such directory; give an existing model directory")


def test_the_lora_demo_before_its_base_is_written_says_how_to_write_it(monkeypatch, tmp_path):
    """configs/demo_lora.yaml run directly, before `make demo-lora` wrote its base: not a hub error."""
    from sft.config import ModelConfig
    from sft.models.build import ModelError
    from sft.hub.tokenizer import load_tokenizer

    monkeypatch.chdir(tmp_path)
    name = yaml.safe_load((REPO / "configs" / "demo_lora.yaml").read_text())["model"]["name_or_path"]
    with pytest.raises(ModelError) as err:
        load_tokenizer(ModelConfig(name_or_path=name))
    assert str(err.value) == "model.name_or_path='./runs/demo_lora_base': no such directory; `make demo-lora` writes it"


# Each `python -m sft.<tool>`: bad input is one line naming the problem, exit status 2, no traceback.
CLI_ERRORS = {
    "config": ("sft.config.__main__", ["no/such.yaml"], "error: config file no/such.yaml not found"),
    "run-dir": ("sft.config.__main__", ["--run-dir", "configs/demo.yaml", "ac.ratio=2"], "ac.ratio=2.0: must be in [0, 1]"),
    "plan": ("sft.plan", ["--config", "configs/demo.yaml", "--gpus", "2", "ac.ratio=2"], "ac.ratio=2.0: must be in [0, 1]"),
    "export": ("sft.export", ["no/such/step-5", "out"],
               "error: no/such/step-5 is not a usable checkpoint (no such directory): give a committed checkpoints/step-N"),
    "data": ("sft.data.__main__", ["--config", "configs/demo.yaml", "data.path=no/such.jsonl"], "data.path='no/such.jsonl': file not found"),
    "chat": ("sft.chat", ["runs/no/such/export", "--prompt", "hi"],
             "error: runs/no/such/export: not a model directory (no config.json or adapter_config.json there)"),
    "config, an override that is not YAML": ("sft.config.__main__", ["configs/demo.yaml", "data.chat_template_kwargs={a: 1"],
                                             "the value is not valid YAML"),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    """Exported LoRA adapters gone wrong: one whose base was moved away, and one each whose
    adapter_model.safetensors is truncated, garbage or empty (onto a real base)."""
    import json

    import torch
    from safetensors.torch import save_file

    from helpers import model_dir
    from sft.config import ModelConfig
    from sft.hub.layout import write_safetensors
    from sft.hub.weights import RandomWeights

    tmp = tmp_path_factory.mktemp("adapters")
    base = model_dir(tmp)
    weights = RandomWeights(ModelConfig(name_or_path=str(base), init="random"), 0)
    write_safetensors(((n, weights.read(n, (), torch.device("cpu"))) for n, _ in weights.reference.named_parameters()),
                      base)
    adapters = {}
    for case, base_path in (("moved base", tmp / "moved"), ("truncated", base), ("garbage", base), ("empty", base)):
        out = adapters[case] = tmp / case.replace(" ", "_")
        out.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (out / name).write_bytes((base / name).read_bytes())
        (out / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "base_model_name_or_path":
                                                             str(base_path)}))
        a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        save_file({a: torch.zeros(2, 64), a.replace("lora_A", "lora_B"): torch.zeros(64, 2)},
                  out / "adapter_model.safetensors")
        data = (out / "adapter_model.safetensors").read_bytes()
        (out / "adapter_model.safetensors").write_bytes({"moved base": data, "truncated": data[:-50],
                                                         "garbage": bytes(range(256)) * 2, "empty": b""}[case])
    return adapters


@pytest.mark.parametrize("case, message", [
    ("moved base", "adapter_config.json: its base_model_name_or_path '{tmp}/moved' cannot be loaded ("),
    ("truncated", "{tmp}/truncated: the adapter cannot be read ("),
    ("garbage", "{tmp}/garbage: the adapter cannot be read ("),
    ("empty", "{tmp}/empty: the adapter cannot be read (Error while deserializing header: header too small)"),
])
def test_chat_on_a_broken_adapter_is_one_line(adapters, case, message, capsys):
    from sft.chat import main

    status, _, err = run_cli(main, [str(adapters[case]), "--prompt", "hi"], capsys)
    assert status == 2 and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert message.format(tmp=adapters[case].parent) in err


@pytest.mark.parametrize("tool", CLI_ERRORS)
def test_command_line_tools_report_bad_input_in_one_line(tool, monkeypatch, capsys):
    module, argv, message = CLI_ERRORS[tool]
    monkeypatch.chdir(REPO)
    status, _, err = run_cli(importlib.import_module(module).main, argv, capsys)
    assert status == 2, err
    assert message in err and "Traceback" not in err


def test_the_config_tool_answers_help(capsys):
    from sft.config.__main__ import main

    status, out, _ = run_cli(main, ["--help"], capsys)
    assert status == 0 and "python -m sft.config --run-dir CONFIG [overrides]" in out


def test_the_planner_does_not_need_the_data_files_or_optional_packages(tmp_path, monkeypatch, capsys):
    """Planning happens on a login node, where the data, the checkpoint to resume or the optional
    packages the run asks for may not be."""
    from sft.plan import main

    monkeypatch.chdir(REPO)
    status, out, err = run_cli(main, ["--config", "configs/demo.yaml", "--gpus", "2", f"data.path={tmp_path}/absent.jsonl",
                                      f"checkpoint.resume={tmp_path}/absent/step-5", "logging.wandb_project=absent-package"],
                               capsys)
    assert status == 0, err
    assert "this config (micro-batch" in out


@pytest.mark.parametrize("path, local", [
    ("Qwen/Qwen2.5-7B", False), ("gpt2", False), ("configs/demo", True), ("./m", True), ("/abs/m", True),
    ("a/b/c", True), ("data.jsonl", True), ("org/not-here", False),
])
def test_a_path_is_local_by_its_form_or_because_the_directory_is_here(path, local):
    """`configs/demo` has the form of a hub id ('org/name') but is a directory here: local, as
    transformers reads it, so an exported adapter names its base by the absolute path."""
    from sft.config import is_local_path

    assert is_local_path(path) == local


def test_a_retired_key_is_dropped_from_a_saved_config_and_named_in_a_config_file(tmp_path):
    """Checkpoints written before moe.router_fp32 was retired hold it in their config.yaml: they still
    load (and export); a config file that sets it gets one line saying to remove it."""
    from sft.config import ConfigError, load_config, read_resolved_config, to_yaml

    data = tmp_path / "d.jsonl"
    data.touch()
    cfg = load_config(REPO / "configs" / "demo.yaml", [f"data.path={data}", "data.eval_path=null"])
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg).replace("moe:\n", "moe:\n  router_fp32: true\n"))
    assert read_resolved_config(saved) == cfg
    with pytest.raises(ConfigError, match="moe.router_fp32: retired .*; remove it"):
        load_config(REPO / "configs" / "demo.yaml", [f"data.path={data}", "data.eval_path=null", "moe.router_fp32=true"])
