"""check_mismatch and bisect, run as a user would (through main)."""
import json

import pytest

from nemo_rz.tools import bisect, check_mismatch


def test_check_mismatch_reports_zero_in_consistent_mode_and_differences_in_fast(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert check_mismatch.main(["--batch-sizes", "1", "8", "--max-new-tokens", "12", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["diff_tokens"] for r in rows] == [0, 0] and all(r["tokens"] > 0 for r in rows)
    assert "differ" in capsys.readouterr().out
    check_mismatch.main(["--batch-sizes", "8", "--max-new-tokens", "12", "--kernels", "fast", "--out", str(out)])
    assert json.loads(out.read_text())["rows"][0]["diff_tokens"] > 0


def test_bisect_finds_nothing_when_consistent_and_names_the_op_forced_fast(capsys):
    assert bisect.main(["--new-tokens", "6"]) == 0
    assert "no op differs" in capsys.readouterr().out
    assert bisect.main(["--new-tokens", "6", "--force-fast", "attention"]) == 1
    assert "attention in model.layers.0.self_attn" in capsys.readouterr().out
    assert bisect.main(["--new-tokens", "6", "--force-fast", "linear"]) == 1
    assert "linear in model.layers.0.self_attn.q_proj" in capsys.readouterr().out


def test_tools_reject_bad_arguments_with_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        bisect.main(["--force-fast", "softmax"])
    assert e.value.code == 2 and "is not an op" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        check_mismatch.main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error:") and err.count("\n") == 1
