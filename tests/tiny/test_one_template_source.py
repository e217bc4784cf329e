"""One source for the tiny Beam's chat template: `beam_hpu/tiny/data/chat_template.jinja`. The
committed trained checkpoint carries a copy (a checkpoint directory must hold its own template:
vLLM, transformers and the demo read it there); it is the file `write_tokenizer` generates from the
source, byte for byte, with the tokenizer files beside it."""

import filecmp

from beam_hpu.tiny.checkpoint import DATA, TRAINED_DIR, write_tokenizer


def test_the_trained_checkpoint_holds_what_the_source_generates(tmp_path):
    write_tokenizer(tmp_path)
    generated = sorted(p.name for p in tmp_path.iterdir())
    assert "chat_template.jinja" in generated
    stale = [name for name in generated if not filecmp.cmp(tmp_path / name, TRAINED_DIR / name, shallow=False)]
    assert stale == [], (f"{stale} in {TRAINED_DIR} differ from what {DATA / 'chat_template.jinja'} generates: "
                         f"run beam_hpu.tiny.checkpoint.write_tokenizer(TRAINED_DIR)")


def test_an_edited_source_is_seen(tmp_path, monkeypatch):
    from beam_hpu.tiny import checkpoint

    edited = tmp_path / "data"
    edited.mkdir()
    (edited / "chat_template.jinja").write_text((DATA / "chat_template.jinja").read_text() + "{# edited #}")
    monkeypatch.setattr(checkpoint, "DATA", edited)
    out = tmp_path / "out"
    out.mkdir()
    write_tokenizer(out)
    assert not filecmp.cmp(out / "chat_template.jinja", TRAINED_DIR / "chat_template.jinja", shallow=False)
