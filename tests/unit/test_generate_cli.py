"""The `generate` command: text and stats, `--json`, prompt order, and every bad input named."""
from __future__ import annotations

import dataclasses
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_fixtures import save_pair, tiny_config, tiny_pair
from workers.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A byte-vocabulary tiny pair (BOS 256, EOS 257) with a 96-token context."""
    cfg = dataclasses.replace(tiny_config(vocab=264, max_pos=96, eos=257), bos_token_id=256)
    return save_pair(*tiny_pair(seed=4, cfg=cfg), tmp_path_factory.mktemp("pair"))


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_text_and_stats_table(capsys, model_dir) -> None:
    code, out, _ = _run(capsys, "--prompt", "def fib(n):", "--steps", "3", "--model", str(model_dir),
                        "--max-new-tokens", "20")
    assert code == 0
    assert out.startswith("=== prompt 0 ===\ndef fib(n):")
    for row in ("mode                static steps=3", "mean accept length", "tokens/s",
                "tier switches", "accept histogram"):
        assert row in out


def test_json_outputs_in_prompt_order_and_equal_to_single_runs(capsys, model_dir, tmp_path) -> None:
    prompts = ["import os\n", "x = [", "while True:"]
    file = tmp_path / "p.jsonl"
    file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts) + "\n")
    code, out, _ = _run(capsys, "--prompts", str(file), "--adaptive", "--model", str(model_dir),
                        "--max-new-tokens", "24", "--json")
    assert code == 0
    got = _json(out)
    assert set(got) >= {"outputs", "mean_accept_length", "accept_histogram", "tokens_per_second",
                        "switches"}
    assert len(got["outputs"]) == 3 and got["mode"].startswith("adaptive")
    hist = {int(k): v for k, v in got["accept_histogram"].items()}
    assert got["mean_accept_length"] == pytest.approx(
        sum(k * v for k, v in hist.items()) / sum(hist.values()))
    for i, (prompt, item) in enumerate(zip(prompts, got["outputs"])):
        ragged = ["--padded-prefill-tokens", "0"] if i % 2 else []   # either prefill path
        _, single, _ = _run(capsys, "--prompt", prompt, "--no-spec", "--model", str(model_dir),
                            "--max-new-tokens", "24", "--json", *ragged)
        assert _json(single)["outputs"][0]["token_ids"] == item["token_ids"]
        assert item["text"] == bytes(t for t in item["token_ids"] if t < 256).decode("utf-8", "replace")


def test_no_spec_json_has_no_accept_length(capsys, model_dir) -> None:
    code, out, _ = _run(capsys, "--prompt", "a", "--no-spec", "--model", str(model_dir),
                        "--max-new-tokens", "5", "--json", "--temperature", "0.8", "--top-p", "0.9",
                        "--seed", "3")
    got = _json(out)
    assert code == 0 and got["mean_accept_length"] is None and got["accept_histogram"] == {}
    assert len(got["outputs"][0]["token_ids"]) == 5


def _corrupt(model_dir: Path, tmp_path: Path) -> Path:
    bad = tmp_path / "corrupt"
    for sub in ("target", "eagle"):
        (bad / sub).mkdir(parents=True)
        for f in (model_dir / sub).iterdir():
            (bad / sub / f.name).write_bytes(f.read_bytes())
    (bad / "target" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    return bad


def _foreign_arch(model_dir: Path, tmp_path: Path) -> Path:
    other = tmp_path / "gpt2"
    (other / "target").mkdir(parents=True)
    cfg = json.loads((model_dir / "target" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (other / "target" / "config.json").write_text(json.dumps(cfg))
    return other


@pytest.mark.parametrize("argv,match", [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "x" * 96], "prompt 0: 97 prompt tokens \\+ --max-new-tokens 128 = 225 exceeds "
                             "the model's context of 96 tokens"),
    (["--prompt", "x" * 60, "--max-new-tokens", "40"], "prompt 0: 61 prompt tokens \\+ "
                                                       "--max-new-tokens 40 = 101 exceeds"),
    (["--prompt", "a", "--max-new-tokens", "99999999999999999999"], "= 100000000000000000001 "
                                                                    "exceeds the model's context"),
    (["--prompt", "a", "--steps", "100000"], "--steps 100000: draft depth 100000 is beyond the "
                                             "maximum of 32"),
    (["--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens 0: must be an integer >= 1"),
    (["--prompt", "a", "--max-new-tokens", "-5"], "--max-new-tokens -5: must be an integer >= 1"),
    (["--prompt", "a", "--temperature", "-1"], "--temperature -1.0: must be a finite number >= 0"),
    (["--prompt", "a", "--top-p", "0"], r"--top-p 0.0: must be in \(0, 1\]"),
    (["--prompt", "a", "--top-p", "1.5"], r"--top-p 1.5: must be in \(0, 1\]"),
    (["--prompt", "a", "--steps", "0"], "--steps 0: must be >= 1"),
    (["--prompt", "a", "--max-batch-size", "0"], "--max-batch-size 0: must be >= 1"),
    (["--prompt", "a", "--padded-prefill-tokens", "-1"], "--padded-prefill-tokens -1: must be >= 0"),
    (["--prompt", "a", "--catchup-rounds", "0"], "--catchup-rounds 0: must be >= 1"),
    (["--prompt", "a", "--defer-prefill-width", "-1"], "--defer-prefill-width -1: must be >= 0"),
    (["--prompt", "a", "--dp", "3"], "--dp 3 x --attn-tp 1 = 3 ranks, but this job has 1"),
    (["--prompt", "a", "--steps", "3", "--config", "c.json"], "adaptive mode is off"),
    (["--prompt", "a", "--no-spec", "--config", "c.json"], "--config applies to --adaptive only"),
    (["--prompt", "a", "--tp", "2"], "--dp 1 x --attn-tp 2 = 2 ranks, but this job has 1"),
    (["--prompts", "missing.jsonl"], "--prompts: file 'missing.jsonl' does not exist"),
])
def test_bad_input_is_named(capsys, model_dir, argv: list[str], match: str) -> None:
    code, out, err = _run(capsys, *argv, "--model", str(model_dir))
    assert code == 2 and out == ""
    assert re.search(match, err), err


def test_bad_prompts_file_line_is_named(capsys, model_dir, tmp_path) -> None:
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    code, _, err = _run(capsys, "--prompts", str(file), "--model", str(model_dir))
    assert code == 2 and f"{file}:2: expected an object" in err


def test_checkpoint_errors_are_named(capsys, model_dir, tmp_path) -> None:
    code, _, err = _run(capsys, "--prompt", "a", "--model", str(tmp_path / "nowhere"))
    assert code == 2 and "nowhere' does not exist" in err
    code, _, err = _run(capsys, "--prompt", "a", "--model", str(_corrupt(model_dir, tmp_path)))
    assert code == 2 and "model.safetensors" in err and "not a readable safetensors file" in err
    code, _, err = _run(capsys, "--prompt", "a", "--model", str(_foreign_arch(model_dir, tmp_path)))
    assert code == 2 and "unsupported architecture ['GPT2LMHeadModel']" in err
    half = tmp_path / "half"
    (half / "target").mkdir(parents=True)
    (half / "target" / "config.json").write_text((model_dir / "target" / "config.json").read_text())
    code, _, err = _run(capsys, "--prompt", "a", "--model", str(half))
    assert code == 2 and "has neither model.safetensors nor model.safetensors.index.json" in err


def test_unknown_backend_is_refused_by_the_parser(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "a", "--attention-backend", "paged"])
    assert exc.value.code == 2
    assert "invalid choice: 'paged'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_flashinfer_without_gpu_is_a_clear_error(capsys, model_dir) -> None:
    code, _, err = _run(capsys, "--prompt", "a", "--attention-backend", "flashinfer",
                        "--model", str(model_dir))
    assert code == 2 and "--device cuda: this torch build or machine has no CUDA device" in err
    code, _, err = _run(capsys, "--prompt", "a", "--attention-backend", "flashinfer",
                        "--device", "cpu", "--model", str(model_dir))
    assert code == 2 and "--attention-backend flashinfer needs --device cuda" in err


def test_python_dash_m_adaptive_dist_generate(model_dir) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "adaptive_dist", "generate", "--prompt", "x = ",
                           "--no-spec", "--max-new-tokens", "4", "--json", "--model", str(model_dir)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(_json(proc.stdout)["outputs"][0]["token_ids"]) == 4


def test_depth_beyond_the_maximum_in_a_config_file_is_named(capsys, model_dir, tmp_path) -> None:
    cfg = tmp_path / "deep.json"
    cfg.write_text('{"candidate_steps": [1, 3, 5000], "initial_steps": 3}')
    code, out, err = _run(capsys, "--prompt", "a", "--adaptive", "--config", str(cfg),
                          "--max-new-tokens", "4", "--model", str(model_dir))
    assert code == 2 and out == ""
    assert "candidate_steps: draft depth 5000 is beyond the maximum of 32 steps" in err, err
