"""`ctr data tokenize --sentencepiece`: a model trained with spm_train on this
test's own corpus tokenizes documents into an llm.c token file, which is read
back byte by byte (independently of the library that wrote it): the documents'
ids with the model's end-of-sentence id between them, each decoding to its
document, and `ctr run` trains on the file.

usage: pytest test_sentencepiece.py   (CTR=path/to/ctr in the environment)
"""
import json
import os
import shutil
import struct
import subprocess

import pytest

CTR = os.path.abspath(os.environ.get("CTR", "build/tools/ctr"))

DOCS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine and the early bird catches the worm",
    "every good boy deserves fudge while the cat sat on the mat",
]


def ctr(*args, timeout=120):
    return subprocess.run([CTR, *args], capture_output=True, text=True, timeout=timeout)


def read_llmc(path):
    raw = open(path, "rb").read()
    magic, version, count = struct.unpack_from("<iii", raw, 0)
    width = {20240520: 2, 20240801: 4}[magic]
    body = raw[256 * 4:]
    assert len(body) == count * width, f"{path}: header says {count} tokens, body holds {len(body) // width}"
    return list(struct.unpack(f"<{count}{'H' if width == 2 else 'I'}", body))


def built_with_sentencepiece(tmp_path):
    p = ctr("data", "tokenize", str(tmp_path / "none.txt"), "-o", str(tmp_path / "x.bin"),
            "--sentencepiece", str(tmp_path / "none.model"))
    return "built without libsentencepiece" not in p.stderr


@pytest.fixture
def model(tmp_path):
    if not shutil.which("spm_train"):
        pytest.skip("spm_train is not installed (Debian: sentencepiece)")
    if not built_with_sentencepiece(tmp_path):
        pytest.skip("this ctr was built without libsentencepiece (Debian: libsentencepiece-dev)")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(DOCS * 4) + "\n")
    subprocess.run(["spm_train", f"--input={corpus}", f"--model_prefix={tmp_path / 'm'}", "--vocab_size=60",
                    "--character_coverage=1.0", "--hard_vocab_limit=false", "--num_threads=1",
                    "--minloglevel=2"], check=True, capture_output=True, timeout=60)
    return str(tmp_path / "m.model")


def test_tokens_round_trip_with_eot_between_documents(model, tmp_path):
    files = []
    for i, d in enumerate(DOCS):
        files.append(str(tmp_path / f"doc{i}.txt"))
        open(files[-1], "w").write(d)
    out = str(tmp_path / "docs.bin")
    p = ctr("data", "tokenize", *files, "-o", out, "--sentencepiece", model)
    assert p.returncode == 0, p.stderr
    tokens = read_llmc(out)

    eos = 2  # spm_train's default end-of-sentence id
    docs, cur = [], []
    for t in tokens:
        if t == eos:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    docs.append(cur)
    assert len(docs) == len(DOCS), f"{len(docs)} documents between end-of-text ids, expected {len(DOCS)}"
    assert all(docs), "an empty document"
    ids = str(tmp_path / "ids.txt")
    open(ids, "w").write("".join(" ".join(map(str, d)) + "\n" for d in docs))
    dec = subprocess.run(["spm_decode", f"--model={model}", "--input_format=id", ids],
                         check=True, capture_output=True, text=True, timeout=60)
    assert dec.stdout.splitlines() == DOCS

    # `ctr run` trains on the file.
    graph = str(tmp_path / "g.ctrg")
    p = ctr("graph", "build", "--preset", "gpt", "--layers", "1", "--dim", "32", "--heads", "2",
            "--vocab", "64", "--seq", "8", "-o", graph)
    assert p.returncode == 0, p.stderr
    metrics = str(tmp_path / "m.jsonl")
    p = ctr("run", graph, "--data", out, "--steps", "3", "--batch", "2", "--seq", "8", "--log-every", "0",
            "--metrics", metrics, "--save-dir", str(tmp_path / "ck"))
    assert p.returncode == 0, p.stderr
    losses = [json.loads(line)["loss"] for line in open(metrics)]
    assert len(losses) == 3 and all(x == x and x > 0 for x in losses), losses


def test_explicit_eot_and_missing_model(model, tmp_path):
    doc = tmp_path / "a.txt"
    doc.write_text(DOCS[0])
    out = str(tmp_path / "a.bin")
    p = ctr("data", "tokenize", str(doc), str(doc), "-o", out, "--sentencepiece", model, "--eot", "70000")
    assert p.returncode == 0, p.stderr
    assert struct.unpack_from("<i", open(out, "rb").read(), 0)[0] == 20240801  # ids past 65535: 4-byte tokens
    assert read_llmc(out).count(70000) == 1
    p = ctr("data", "tokenize", str(doc), "-o", out, "--sentencepiece", str(tmp_path / "absent.model"))
    assert p.returncode == 1 and "cannot load the SentencePiece model" in p.stderr, p.stderr
