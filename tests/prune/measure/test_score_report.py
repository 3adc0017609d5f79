"""The per-block profile a user reads: the score table and the linearity plot."""

from prune.measure.score_report import plot_linearity_profile, score_table


def test_score_table_has_a_row_per_block_and_marks_the_dropped_ones():
    scores = {"cosine": [0.1, 0.25, 0.5], "linearity": [0.9, 0.95, 0.99]}
    lines = score_table(scores, dropped=[1]).splitlines()
    assert lines[0] == "| block | cosine | linearity | dropped |"
    assert lines[1] == "|---:|---:|---:|:---:|"
    assert lines[2:] == ["| 0 | 0.1000 | 0.9000 |  |", "| 1 | 0.2500 | 0.9500 | x |", "| 2 | 0.5000 | 0.9900 |  |"]
    units = score_table({"cosine": [0.1, 0.2]}, labels=["0.attention", "0.mlp"]).splitlines()
    assert units[0] == "| unit | cosine | dropped |" and units[3] == "| 0.mlp | 0.2000 |  |"


def test_linearity_profile_is_a_png(tmp_path):
    scores = {"linearity": [0.9, 0.95, 0.97, 0.99], "linearity-nores": [0.2, 0.4, 0.3, 0.5]}
    path = plot_linearity_profile(scores, tmp_path / "profile.png", "tiny", dropped=[2])
    assert path == tmp_path / "profile.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

