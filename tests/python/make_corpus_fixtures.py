"""Writes the corpus fixtures of accelerate-text's tests (tests/fixtures/corpus/) and, beside them,
expected.json: what each file holds, computed here in Python, independently of the Rust reader.

Parquet files are written by pyarrow (as `datasets` writes them); the line and document splits of
the text file are the ones of `datasets`' own text builder; the validation split boundaries are
`datasets`' percent slicing (`train[:N%]`), as run_clm.py asks for them.

Usage: make_corpus_fixtures.py [OUT_DIR]   (default: tests/fixtures/corpus beside this script)
The tests never run Python; re-run this script only to change the fixtures, and commit its output.
"""

import json
import os
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
from datasets import load_dataset
from datasets.arrow_reader import ReadInstruction


def blank(text):
    # What the Rust corpus skips: no document, or one of white space only (str.isspace's notion
    # matches Rust's char::is_whitespace on these fixtures, which hold no exotic spaces).
    return text is None or text.strip() == ""


def documents(values, positions):
    return [{"position": p, "text": v} for v, p in zip(values, positions) if not blank(v)]


def write_parquet(out):
    texts = [
        "The first document.",
        None,
        "",
        "   \t ",
        "héllo wörld — 東京",
        "two\nlines",
        "row six",
        "row seven",
        None,
        "row nine, in the third row group",
        "the last row",
    ]
    table = pa.table(
        {
            "text": pa.array(texts, type=pa.string()),
            "id": pa.array(range(len(texts)), type=pa.int64()),
            "label": pa.array([t.encode() if t else b"" for t in texts], type=pa.binary()),
            "score": pa.array([0.5 * i for i in range(len(texts))], type=pa.float32()),
        }
    )
    # Several row groups, snappy, dictionary-encoded strings: pyarrow's (and datasets') defaults
    # apart from the row-group size.
    path = os.path.join(out, "rows.parquet")
    pq.write_table(table, path, row_group_size=4, compression="snappy")
    meta = pq.ParquetFile(path).metadata
    assert meta.num_row_groups == 3, meta.num_row_groups

    content = ["alpha", "beta", "  ", "gamma delta"]
    plain = pa.table({"content": pa.array(content, type=pa.large_string())})
    plain_path = os.path.join(out, "plain.parquet")
    # Uncompressed, plain encoding (no dictionary), one row group, a large_string column.
    pq.write_table(plain, plain_path, compression="none", use_dictionary=False)

    return {
        "rows.parquet": {
            "row_groups": meta.num_row_groups,
            "columns": table.column_names,
            "text": documents(texts, range(len(texts))),
        },
        "plain.parquet": {
            "row_groups": pq.ParquetFile(plain_path).metadata.num_row_groups,
            "columns": plain.column_names,
            "content": documents(content, range(len(content))),
        },
    }


def write_jsonl(out):
    lines = [
        json.dumps({"text": "first line's text", "meta": {"source": "a"}}),
        "",
        json.dumps({"text": "ünïcödé and emoji 🚀", "id": 2}),
        "   ",
        json.dumps({"text": "   ", "id": 3}),
        json.dumps({"id": 4, "messages": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "hello"}]}),
        json.dumps({"text": "text wins over messages", "messages": [{"role": "user", "content": "x"}]}),
        json.dumps({"text": "a\nmulti-line\ttext"}),
    ]
    with open(os.path.join(out, "mixed.jsonl"), "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(lines) + "\n")
    expected = []
    for number, line in enumerate(lines, start=1):
        if line.strip() == "":
            continue
        record = json.loads(line)
        if "text" in record:
            if not blank(record["text"]):
                expected.append({"position": number, "text": record["text"]})
        else:
            expected.append({"position": number, "messages": record["messages"]})

    chats = [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}],
        [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "blue"}],
    ]
    with open(os.path.join(out, "chat.jsonl"), "w", encoding="utf-8", newline="\n") as f:
        for i, chat in enumerate(chats):
            f.write(json.dumps({"messages": chat, "id": i}) + "\n")

    with open(os.path.join(out, "missing_field.jsonl"), "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps({"text": "fine"}) + "\n")
        f.write(json.dumps({"body": "no text here", "id": 7}) + "\n")

    with open(os.path.join(out, "bad_json.jsonl"), "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps({"text": "fine"}) + "\n\n")
        f.write('{"text": "unterminated\n')

    return {
        "mixed.jsonl": {"text": expected},
        "chat.jsonl": {"messages": [{"position": i + 1, "messages": c} for i, c in enumerate(chats)]},
    }


def text_builder(path, sample_by):
    ds = load_dataset("text", data_files=path, sample_by=sample_by, split="train",
                      cache_dir=tempfile.mkdtemp())
    return ds["text"]


def write_text(out):
    # CRLF and LF line ends, blank and white-space-only lines, a triple newline, no final newline.
    raw = (
        "Line one of the first paragraph.\r\n"
        "Line two of the first paragraph.\n"
        "\n"
        "Second paragraph, one line.\r\n"
        "\r\n"
        "   \n"
        "Third paragraph after a blank and a white-space line.\n"
        "\n"
        "\n"
        "Fourth paragraph, after two blank lines.\n"
        "  indented line of the fourth paragraph\n"
        "\n"
        "Last line, no newline at the end"
    )
    path = os.path.join(out, "lines.txt")
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(raw)

    # datasets' line and document samples, with positions: the line number, and 1 for the file.
    by_line = text_builder(path, "line")
    lines = documents(by_line, range(1, len(by_line) + 1))
    (whole,) = text_builder(path, "document")
    # Paragraphs as the Rust corpus defines them: maximal runs of non-blank lines, joined by
    # "\n", numbered by their first line. (datasets splits on "\n\n" only, which differs when
    # a blank line holds spaces or three newlines follow each other.)
    paragraphs, current, first = [], [], None
    for number, line in enumerate(by_line, start=1):
        if line.strip() == "":
            if current:
                paragraphs.append({"position": first, "text": "\n".join(current)})
            current = []
        else:
            if not current:
                first = number
            current.append(line)
    if current:
        paragraphs.append({"position": first, "text": "\n".join(current)})
    return {
        "lines.txt": {
            "line": lines,
            "paragraph": paragraphs,
            "document": [{"position": 1, "text": whole}],
        }
    }


def splits():
    # run_clm.py: validation = train[:N%], train = train[N%:] (rounding "closest").
    table = []
    for n in [1, 2, 3, 5, 7, 10, 19, 20, 21, 40, 99, 100, 101, 1000, 12345]:
        for p in [1, 5, 10, 15, 25, 33, 50, 75, 99]:
            (held,) = ReadInstruction("train", to=p, unit="%").to_absolute({"train": n})
            (rest,) = ReadInstruction("train", from_=p, unit="%").to_absolute({"train": n})
            assert held.to == rest.from_
            table.append({"documents": n, "percentage": p, "validation": held.to})
    return table


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "corpus")
    os.makedirs(out, exist_ok=True)
    expected = {}
    expected.update(write_parquet(out))
    expected.update(write_jsonl(out))
    expected.update(write_text(out))
    expected["validation_split"] = splits()
    with open(os.path.join(out, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote the corpus fixtures to {os.path.normpath(out)}")


if __name__ == "__main__":
    main()
