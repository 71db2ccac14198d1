"""The captured Go wire vectors are in the repository, complete."""

from __future__ import annotations

from vectors import EXPECTED_VECTORS, VECTOR_DIR, load_frames


def test_every_expected_vector_is_in_the_repository() -> None:
    present = sorted(path.name for path in VECTOR_DIR.glob("*.hex"))
    assert present == sorted(EXPECTED_VECTORS), "tests/data/vectors and vectors.EXPECTED_VECTORS differ"
    for name in EXPECTED_VECTORS:
        assert load_frames(name), f"{name} holds no frame"


def test_the_vectors_readme_travels_with_them() -> None:
    assert "captured" in (VECTOR_DIR / "README.md").read_text(encoding="utf-8")
