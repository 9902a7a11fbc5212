"""Local data files: plain and gzipped files read alike, and every malformed file is named
with its line (missing files, unpaired parallel lines, bad bytes, corrupt gzip, bad TSV
rows and CoNLL sentences). All files are small ones the tests write themselves."""

from __future__ import annotations

import gzip

import pytest
from test_data import write

from transformer_jax.data import readers
from transformer_jax.data.readers import DataFormatError


def test_local_files_plain_and_gzipped_read_the_same(tmp_path):
  lines_de, lines_en = ["Ein Hund läuft .", "Zwei Katzen"], ["A dog runs .", "Two cats"]
  plain, zipped = tmp_path / "plain", tmp_path / "zipped"
  plain.mkdir(), zipped.mkdir()
  for folder, gz in ((plain, False), (zipped, True)):
    write(folder / "train.de", lines_de, gz)
    write(folder / "train.en", lines_en, gz)
  read = lambda folder: readers.read_parallel(readers.find_file(str(folder), "train.de"),
                                              readers.find_file(str(folder), "train.en"))
  assert read(plain) == read(zipped) == [
      {"source": "Ein Hund läuft .", "target": "A dog runs ."},
      {"source": "Zwei Katzen", "target": "Two cats"}]


def test_missing_file_lists_the_folder(tmp_path):
  write(tmp_path / "train.de", ["x"])
  with pytest.raises(FileNotFoundError, match=r"'train\.en'.*train\.de"):
    readers.find_file(str(tmp_path), "train.en")
  with pytest.raises(FileNotFoundError, match="data.dir"):
    readers.find_file(str(tmp_path / "nowhere"), "train.en")


def test_parallel_files_with_different_line_counts_name_the_unpaired_line(tmp_path):
  src = write(tmp_path / "train.de", ["a", "b", "c"])
  tgt = write(tmp_path / "train.en", ["a", "b"])
  with pytest.raises(DataFormatError, match=r"has 3 lines.*has 2.*train\.de:3"):
    readers.read_parallel(src, tgt)


def test_non_utf8_byte_names_file_and_line(tmp_path):
  path = tmp_path / "train.tsv"
  path.write_bytes(b"sentence\tlabel\ngood\t1\nbad \xff byte\t0\n")
  with pytest.raises(DataFormatError, match=r"train\.tsv:3: not valid UTF-8 \(byte 0xff"):
    readers.read_tsv(str(path), ["neg", "pos"])
  gz = tmp_path / "x.de.gz"
  gz.write_bytes(gzip.compress(b"fine\nstill fine\n\xc3\x28\n"))
  with pytest.raises(DataFormatError, match=r"x\.de\.gz:3: not valid UTF-8"):
    list(readers.read_lines(str(gz)))


def test_corrupt_gzip_is_reported(tmp_path):
  path = tmp_path / "train.en.gz"
  path.write_bytes(b"not gzip at all")
  with pytest.raises(DataFormatError, match=r"train\.en\.gz: not a readable gzip"):
    list(readers.read_lines(str(path)))


def test_tsv_rows_labels_and_errors(tmp_path):
  good = write(tmp_path / "good.tsv", ["sentence\tlabel", "a fine film \t1", "dull\t0",
                                       "by name\tneg", ""])
  assert readers.read_tsv(good, ["neg", "pos"]) == [
      {"text": "a fine film", "label": 1}, {"text": "dull", "label": 0},
      {"text": "by name", "label": 0}]
  fields = write(tmp_path / "fields.tsv", ["ok\t1", "one\ttoo\tmany"])
  with pytest.raises(DataFormatError, match=r"fields\.tsv:2: expected 2 tab-separated.*found 3"):
    readers.read_tsv(fields, ["neg", "pos"])
  label = write(tmp_path / "label.tsv", ["ok\t1", "ok\t0", "what\t2"])
  with pytest.raises(DataFormatError, match=r"label\.tsv:3: unknown label '2'"):
    readers.read_tsv(label, ["neg", "pos"])


def test_conll_sentences_tags_and_errors(tmp_path):
  good = write(tmp_path / "train.txt", ["-DOCSTART- -X- O", "", "EU NNP B-ORG",
                                        "rejects VBZ O", "", "", "Peter NNP B-PER",
                                        "Blackburn NNP I-PER"])
  sentences = readers.read_conll(good)
  assert [s["words"] for s in sentences] == [["EU", "rejects"], ["Peter", "Blackburn"]]
  assert [s["line"] for s in sentences] == [3, 7]
  names = readers.tag_names_of(sentences)
  assert names == ["O", "B-ORG", "B-PER", "I-PER"]
  assert readers.tag_ids(sentences, names, good)[1] == {"words": ["Peter", "Blackburn"],
                                                        "tags": [2, 3]}
  short = write(tmp_path / "short.txt", ["EU B-ORG", "lonely"])
  with pytest.raises(DataFormatError, match=r"short\.txt:2: expected 'word \.\.\. tag'"):
    readers.read_conll(short)
  bad_tag = write(tmp_path / "bad.txt", ["EU NNP B-ORG", "x NNP PER"])
  with pytest.raises(DataFormatError, match=r"bad\.txt:2: 'PER' is not a BIO tag"):
    readers.read_conll(bad_tag)
  unknown = write(tmp_path / "dev.txt", ["Paris NNP B-ORG", "", "is VBZ O", "Paris NNP B-LOC"])
  with pytest.raises(DataFormatError, match=r"dev\.txt:4: unknown tag 'B-LOC'"):
    readers.tag_ids(readers.read_conll(unknown), names, unknown)
