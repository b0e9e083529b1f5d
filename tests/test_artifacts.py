"""Where a model's artifacts go: beside the model as the user named it, the cache when that is read-only."""

from hotcold.artifacts import artifact_dir, find_artifact_dir


def _linked_model(tmp_path):
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots"
    blobs.mkdir()
    snap.mkdir()
    (blobs / "9f2c").write_bytes(b"GGUF")
    (snap / "model.gguf").symlink_to(blobs / "9f2c")
    return blobs, snap / "model.gguf"


def test_artifacts_of_a_linked_model_sit_beside_the_link(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path / "home"))
    blobs, link = _linked_model(tmp_path)
    assert find_artifact_dir(link, "fp") is None
    d = artifact_dir(link, "fp")
    assert d == link.parent / "model.hotcold" and d.is_dir()
    assert not any(p.name.endswith(".hotcold") for p in blobs.iterdir())
    assert find_artifact_dir(link, "fp") == d


def test_artifacts_beside_a_links_target_are_still_found(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path / "home"))
    blobs, link = _linked_model(tmp_path)
    old = blobs / "9f2c.hotcold"
    old.mkdir()
    assert find_artifact_dir(link, "fp") == old


def test_artifacts_go_to_the_cache_when_beside_cannot_hold_them(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path / "home"))
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "model.hotcold").write_bytes(b"")  # a file where the folder would go
    d = artifact_dir(tmp_path / "model.gguf", "fp")
    assert d == tmp_path / "home" / "model-fp" and d.is_dir()


def test_a_failed_write_leaves_no_empty_folder(tmp_path):
    from hotcold.artifacts import removed_if_left_empty

    empty, used = tmp_path / "a.hotcold", tmp_path / "b.hotcold"
    for d in (empty, used):
        d.mkdir()
    (used / "profile.json").write_text("{}")
    for d in (empty, used):
        try:
            with removed_if_left_empty(d):
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
    assert not empty.exists() and (used / "profile.json").exists()
    with removed_if_left_empty(tmp_path / "c") as d:  # success keeps whatever it is
        d.mkdir()
    assert d.is_dir()
