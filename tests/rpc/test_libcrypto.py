# SPDX-License-Identifier: BSD-3-Clause
"""How the extension finds OpenSSL's libcrypto, and the error without it.

Each case is a fresh interpreter: libcrypto is resolved once per process.
TORCH_RPC_EXT_TEST_LIBCRYPTO replaces the search with the one name given.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Prints a JSON object: what hmac_sha256, libcrypto() and agent creation gave
# (or their RuntimeError text), and the libcrypto files mapped before and
# after the first use.
PROBE = r"""
import hmac, json, os, sys
import _hashlib  # as any Python with hashlib has: loads its libcrypto
import torch.distributed as dist
from torch_rpc_ext import _C, _testing

def mapped():
    with open("/proc/self/maps") as f:
        return sorted({os.path.realpath(l.split()[-1]) for l in f
                       if "/libcrypto" in l})

out = {"before": mapped()}
try:
    d = _testing.hmac_sha256(b"key", b"message")
    out["hmac_ok"] = d == hmac.new(b"key", b"message", "sha256").digest()
    out["libcrypto"] = _testing.libcrypto()
except RuntimeError as e:
    out["hmac_error"] = str(e)
if "tls" in sys.argv:
    try:
        _testing.Endpoint(0, 2, "s" * 32, "tcp", [], encryption="always").close(0)
        out["tls"] = "ok"
    except RuntimeError as e:
        out["tls_error"] = str(e)
if "agent" in sys.argv:
    try:
        _C.Agent(dist.HashStore(), "w0", 0, 1, _C._RpcExtBackendOptionsBase())
        out["agent"] = "created"
    except RuntimeError as e:
        out["agent_error"] = str(e)
out["after"] = mapped()
print(json.dumps(out), flush=True)
os._exit(0)  # an agent created by mistake must not keep us alive
"""


def probe(override=None, *args, libssl=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("TORCH_RPC_EXT_TEST_LIBCRYPTO", None)
    env.pop("TORCH_RPC_EXT_TEST_LIBSSL", None)
    if override is not None:
        env["TORCH_RPC_EXT_TEST_LIBCRYPTO"] = override
    if libssl is not None:
        env["TORCH_RPC_EXT_TEST_LIBSSL"] = libssl
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def loaded_file(description):
    m = re.fullmatch(r".+ \((/.+)\)", description)
    assert m, description
    return os.path.realpath(m.group(1))


def test_default_search_uses_the_libcrypto_python_loaded():
    out = probe()
    assert out["hmac_ok"] is True, out
    if not out["before"]:
        pytest.skip("this Python's _hashlib has OpenSSL built in, not shared")
    # The one hashlib uses, and no second copy.
    assert loaded_file(out["libcrypto"]) in out["before"], out
    assert out["after"] == out["before"], out


def test_absent_libcrypto_is_a_clear_error_at_agent_creation():
    missing = "/nonexistent/libcrypto.so.3"
    out = probe(missing, "agent")
    assert "agent" not in out and "hmac_ok" not in out, out
    for text in (out["hmac_error"], out["agent_error"]):
        assert "OpenSSL's libcrypto" in text
        assert f'dlopen("{missing}")' in text  # what was tried, and why not
        assert "No such file" in text
        assert "install OpenSSL's libcrypto" in text  # how to fix it


def test_the_override_is_what_gets_loaded():
    # Without this, the case above could fail for reasons other than the
    # library being absent.
    real = loaded_file(probe()["libcrypto"])
    out = probe(real)
    assert out["hmac_ok"] is True, out
    assert loaded_file(out["libcrypto"]) == real


def test_a_library_that_is_not_libcrypto_is_refused():
    out = probe("libc.so.6", "agent")
    assert "agent" not in out, out
    assert "libc.so.6: no OpenSSL_version_num" in out["agent_error"], out


# A stand-in for another OpenSSL's libcrypto (or LibreSSL's): the entry
# points the loader asks for, nothing behind them.
FAKE_LIBCRYPTO = r"""
#include <stddef.h>
unsigned long OpenSSL_version_num(void) { return VERSION; }
const char* OpenSSL_version(int t) { (void)t; return TEXT; }
unsigned char* HMAC(const void* md, const void* key, int keylen,
                    const unsigned char* d, size_t n, unsigned char* md_out,
                    unsigned int* md_len) { return 0; }
const void* EVP_sha256(void) { static int md; return &md; }
"""


def build(tmp_path, name, source, *flags):
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler to build a stand-in library")
    src = tmp_path / (name + ".c")
    src.write_text(source)
    out = tmp_path / name
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(src), *flags],
                   check=True, capture_output=True, timeout=120)
    return str(out)


def test_libressl_is_refused_naming_it(tmp_path):
    libre = build(tmp_path, "libcrypto.so.50", FAKE_LIBCRYPTO,
                  "-DVERSION=0x20000000UL", '-DTEXT="LibreSSL 3.9.2"')
    out = probe(libre, "agent")
    assert "agent" not in out, out
    assert "LibreSSL 3.9.2: LibreSSL is not supported" in out["agent_error"], out


def test_a_libssl_built_on_another_libcrypto_is_refused(tmp_path):
    # A "libssl" whose libcrypto is another OpenSSL's: TLS must not start
    # with two OpenSSLs in the process, and the error names both.
    other = build(tmp_path, "libcrypto.so.3", FAKE_LIBCRYPTO,
                  "-DVERSION=0x30000020UL", '-DTEXT="OpenSSL 3.0.2 (elsewhere)"')
    ssl = build(tmp_path, "libssl.so.3", "int stand_in_libssl;\n",
                "-Wl,--no-as-needed", other, "-Wl,-rpath," + str(tmp_path))
    out = probe(None, "tls", libssl=ssl)
    assert "tls" not in out, out
    text = out["tls_error"]
    assert f"its libcrypto is {other}, not the one this process uses" in text, text
    assert out["libcrypto"] in text  # ours, named
    assert "two OpenSSLs in one process are refused" in text


def test_tls_uses_the_libcrypto_the_handshake_uses():
    out = probe(None, "tls")
    assert out.get("tls") == "ok", out
    # One libcrypto file mapped, before and after TLS came up.
    assert len(set(out["after"])) == 1, out
    assert loaded_file(out["libcrypto"]) in out["after"], out
