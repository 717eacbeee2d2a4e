"""The key directory's secret files (`radix_sync.secret_files`): created 0600 (folder 0700), never overwritten, read back
exactly, and a malformed file refused with its path named."""
import json
import os
import stat

import pytest

from radix_sync import secret_files as keys


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_tokens_are_created_once_0600_and_read_back(tmp_path):
    path = tmp_path / "state" / "router-tokens.json"
    tokens, created = keys.ensure_tokens(path)
    assert created and mode(path) == 0o600 and mode(path.parent) == 0o700
    assert len(tokens.read) == len(tokens.write) == 64 and tokens.read != tokens.write
    again, created = keys.ensure_tokens(path)
    assert not created and again == tokens == keys.read_tokens(path)
    with pytest.raises(FileExistsError):
        keys.write_private(path, "x")  # nothing is overwritten
    assert keys.read_tokens(path) == tokens


def test_secrets_are_created_once_and_validated(tmp_path):
    secret, created = keys.ensure_secret(tmp_path / "tenant-secret")
    assert created and len(secret) == keys.TOKEN_BYTES and mode(tmp_path / "tenant-secret") == 0o600
    assert keys.ensure_secret(tmp_path / "tenant-secret") == (secret, False)
    (tmp_path / "short").write_text("abcd")
    (tmp_path / "nothex").write_text("zz" * 32)
    for name in ("short", "nothex", "missing"):
        with pytest.raises(ValueError, match=name):
            keys.read_secret(tmp_path / name)


@pytest.mark.parametrize("content,msg", [("{", "tokens file"), (json.dumps({"read": "a" * 64}), "expected"),
                                         (json.dumps({"read": "a" * 64, "write": "a" * 64}), "must differ"),
                                         (json.dumps({"read": "short", "write": "b" * 64}), ">= 32")])
def test_bad_token_files_are_refused(tmp_path, content, msg):
    (tmp_path / "t.json").write_text(content)
    with pytest.raises(ValueError, match=msg):
        keys.read_tokens(tmp_path / "t.json")
