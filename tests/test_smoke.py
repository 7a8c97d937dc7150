"""`jaxrl-lp bench smoke`: the real programs at real sizes on CPU (slow; up to 16 GB of memory)."""

import argparse
import json
import math

import pytest

from jaxrl_lp.bench import smoke
from jaxrl_lp.cli.main import main
from jaxrl_lp.numerics.policy import Policy


@pytest.mark.slow
def test_smoke_at_real_sizes():
    out = smoke.run(argparse.Namespace(parts=",".join(smoke.PARTS), policy=Policy.parse("bf16")))
    qwen, ouro = out["qwen3-0.6b"], out["ouro-1.4b"]
    assert qwen["params"] > 5e8 and ouro["params"] > 1.4e9
    step = qwen["grpo_step"]
    assert step["tokens"] == 64 and step["skipped"] == 0.0
    assert math.isfinite(step["loss"]) and step["grad_norm"] > 0
    assert ouro["sample_16"]["loop"].endswith("/deferred")
    # 15 decode steps after the prefill, each 1..4 loop steps.
    assert 15 <= ouro["sample_16"]["loop_evals"] <= 60
    for part in (qwen, ouro):
        assert part["peak_rss_bytes"] > 0 and part["sample_16"]["second_s"] > 0


@pytest.mark.slow
# 61 s (Qwen3) and 26 s (Ouro) on 2 shared cores: compiles at real widths
@pytest.mark.parametrize("part", smoke.PARTS)
def test_smoke_parts_at_their_real_widths_on_one_layer(part):
    """The real-size parts' programs at the presets' own widths and head shapes (Qwen3-0.6B:
    16 query heads of 128 over a hidden 1024, GQA 2:1, QK-norm, tied embeddings; Ouro-1.4B:
    hidden 2048, 4 loop steps, deferred), one layer and a 512-token vocabulary: what the
    tiny presets, whose heads times head width is the hidden size, cannot show, in about a
    minute. The full sizes take minutes and 16 GB (the slow test above)."""
    from jaxrl_lp.models.config import get_preset

    cfg = get_preset(part).replace(num_layers=1, vocab_size=512, bos_token_id=0,
                                   eos_token_id=1, pad_token_id=0)
    out = smoke.run_part(cfg, Policy.parse("bf16"))
    assert out["params"] == cfg.param_count()
    if cfg.is_looped:
        assert out["sample_16"]["loop"].endswith("/deferred")
        assert 15 <= out["sample_16"]["loop_evals"] <= 15 * cfg.loop_steps
    else:
        step = out["grpo_step"]
        assert step["tokens"] == 64 and step["skipped"] == 0.0
        assert math.isfinite(step["loss"]) and step["grad_norm"] > 0


def test_smoke_command_at_tiny_sizes(tmp_path):
    """`jaxrl-lp bench smoke` end to end with the tiny presets: the same programs, each part
    in its child process."""
    out = tmp_path / "smoke.json"
    assert main(["bench", "smoke", "--parts", "tiny-qwen3,tiny-ouro", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    step = got["tiny-qwen3"]["grpo_step"]
    assert step["tokens"] == 64 and step["skipped"] == 0.0 and step["grad_norm"] > 0
    assert got["tiny-ouro"]["sample_16"]["loop"].endswith("/deferred")
    assert 15 <= got["tiny-ouro"]["sample_16"]["loop_evals"] <= 15 * 4
    assert got["tiny-qwen3"]["peak_rss_bytes"] > 0


def test_smoke_refuses_unknown_parts(capsys):
    with pytest.raises(ValueError, match="unknown smoke part"):
        smoke.run(argparse.Namespace(parts="llama-70b", policy=Policy.parse("bf16")))
    assert main(["bench", "smoke", "--parts", "llama-70b"]) == 2
    assert "unknown smoke part(s) ['llama-70b']" in capsys.readouterr().err
