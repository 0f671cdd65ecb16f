"""The image placeholder id is resolved from the spec and the tokenizer JSON alone, as `tokenizers` would."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mixplane.tokens import resolve_image_token_id, tokenizer_vocab


def _bpe(path, special=("<unk>", "<|endoftext|>"), added=(), added_special=()):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a small red square", "a blue picture of a cat", "the dog sat"] * 20,
                            trainers.BpeTrainer(vocab_size=80, special_tokens=list(special)))
    if added_special:
        tok.add_special_tokens(list(added_special))
    if added:
        tok.add_tokens(list(added))  # "cat" is in the model vocabulary already, "zzzq" is new
    tok.save(str(path))
    return tok


def _tokenizers_rule(tok, configured):
    """The documented rule, asked of the `tokenizers` library itself."""
    if configured is not None:
        return configured
    for t in ("<|image|>", "<image>", "<|image_pad|>"):
        if tok.token_to_id(t) is not None:
            return tok.token_to_id(t)
    return tok.get_vocab_size(with_added_tokens=True) - 1


@pytest.mark.parametrize("case", ["special", "added-later", "none", "none-with-added", "model-vocab", "unigram"])
def test_image_token_id_matches_tokenizers(tmp_path, case):
    from tokenizers import Tokenizer, models

    path = tmp_path / "tok.json"
    if case == "special":
        tok = _bpe(path, special=("<unk>", "<|endoftext|>", "<|image|>"))
    elif case == "added-later":
        tok = _bpe(path, added_special=("<|image_pad|>",), added=("cat", "zzzq"))
    elif case == "none":
        tok = _bpe(path)
    elif case == "none-with-added":
        tok = _bpe(path, added=("cat", "zzzq"))
    elif case == "model-vocab":  # a candidate that is a plain vocabulary entry; ids need not be dense
        tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<image>": 7}, unk_token="a"))
        tok.save(str(path))
    else:
        tok = Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0), ("<|image|>", -2.0), ("b", -3.0)], 0, False))
        tok.save(str(path))
    assert resolve_image_token_id(None, str(path)) == _tokenizers_rule(tok, None)
    assert resolve_image_token_id(3, str(path)) == 3  # an explicit id always wins
    assert tokenizer_vocab(str(path)) == tok.get_vocab(with_added_tokens=True)


def test_errors_name_the_problem(tmp_path):
    assert resolve_image_token_id(9, None) == 9
    with pytest.raises(ValueError, match="image_token_id or a tokenizer"):
        resolve_image_token_id(None, None)
    with pytest.raises(ValueError, match="missing.json: cannot read tokenizer"):
        resolve_image_token_id(None, str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": {}}')
    with pytest.raises(ValueError, match="bad.json: cannot read tokenizer"):
        resolve_image_token_id(None, str(bad))


def test_constructor_does_not_import_loader_code():
    code = ("import sys, mixplane.constructor.server; "
            "bad = sorted(m for m in sys.modules if m.startswith('mixplane.loader') or m == 'tokenizers'); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
