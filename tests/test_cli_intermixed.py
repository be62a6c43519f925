"""Prompts and options in any order: ``jkv generate "Hi" --method kivi "Second prompt"`` runs two prompts with KIVI.

Plain argparse took a command's positionals only as one run: a prompt after an option was refused as an
unrecognized argument. ``jkv.cli._Parser`` parses a command's options wherever they stand, then its positionals in
their order; ``--`` still ends the options. Most cases check the parsed arguments (no model); one runs the model.
"""

import json

import pytest

from jkv import cli


def parse(*argv):
  return vars(cli.build_parser().parse_args(list(argv)))


MIXED = [
    # The forms that worked before keep their meaning.
    (["generate", "A", "B", "--max-new-tokens", "8"], dict(prompt=["A", "B"], max_new_tokens=8)),
    (["generate", "--max-new-tokens", "8", "Hello"], dict(prompt=["Hello"], max_new_tokens=8)),
    (["generate", "--json"], dict(prompt=[], json=True)),  # no prompt: standard input
    # Prompts on both sides of options (the case), and between an option and its method options.
    (["generate", "Hi", "--method", "kivi", "Second prompt"], dict(prompt=["Hi", "Second prompt"], method="kivi")),
    (["generate", "--json", "A", "--max-new-tokens", "4", "B"], dict(prompt=["A", "B"], json=True, max_new_tokens=4)),
    (["generate", "A", "--method", "kivi", "B", "--bits", "2", "C", "--stream"],
     dict(prompt=["A", "B", "C"], method="kivi", opt_bits=2, stream=True)),
    # A later repeat of an option wins, as in argparse.
    (["generate", "A", "--max-new-tokens", "4", "B", "--max-new-tokens", "5"], dict(prompt=["A", "B"], max_new_tokens=5)),
    # "--" ends the options: what follows is prompts, also what looks like an option.
    (["generate", "--", "-x"], dict(prompt=["-x"])),
    (["generate", "--max-new-tokens", "4", "--", "-x", "--json"], dict(prompt=["-x", "--json"], json=False)),
    (["generate", "A", "--json", "--", "--max-new-tokens"], dict(prompt=["A", "--max-new-tokens"], max_new_tokens=64)),
    # A prompt that starts with "-" but holds a space is a prompt (argparse's rule), wherever it stands.
    (["generate", "--max-new-tokens", "4", "-1 is less than 0?"], dict(prompt=["-1 is less than 0?"])),
    # convert's two positionals around its options.
    (["convert", "--dtype", "bfloat16", "src", "out"], dict(src="src", out="out", dtype="bfloat16")),
    (["convert", "src", "--dtype", "bfloat16", "out", "--json"], dict(src="src", out="out", dtype="bfloat16", json=True)),
    (["convert", "--", "-src", "out"], dict(src="-src", out="out")),
    # Commands without positionals, and nested ones, parse as before.
    (["eval", "passkey", "--lengths", "80", "160", "--trials", "1"], dict(lengths=[80, 160], trials=1)),
    (["compare", "--methods", "dense", "kivi", "--no-passkey"], dict(methods=["dense", "kivi"], no_passkey=True)),
]


@pytest.mark.parametrize("argv, want", MIXED, ids=[" ".join(argv) for argv, _ in MIXED])
def test_prompts_and_options_mix(argv, want):
  args = parse(*argv)
  assert {k: args[k] for k in want} == want


def one_line_error(capsys, argv, *words):
  """``jkv ARGV`` exits 2 with one line ``jkv: error: ...`` naming ``words``, nothing on stdout, no traceback."""
  capsys.readouterr()
  rc = cli.main(list(argv))
  out, err = capsys.readouterr()
  assert rc == 2 and out == "", (rc, out, err)
  assert err.count("\n") == 1 and err.startswith("jkv: error: ") and "Traceback" not in err, err
  for w in words:
    assert w in err, err


MISTAKES = [
    (["generate", "Hi", "--max-new-tokens"], ["--max-new-tokens: expected one argument"]),
    (["generate", "Hi", "--max-new-tokens", "many", "Second"], ["--max-new-tokens", "expected an integer", "'many'"]),
    (["generate", "Hi", "--max-new-tokens", "0", "Second"], ["--max-new-tokens", "must be >= 1"]),
    (["generate", "Hi", "--bogus", "Second"], ["unrecognized arguments: --bogus"]),
    (["generate", "Hi", "-x"], ["unrecognized arguments: -x"]),  # "--" makes it a prompt
    (["generate", "Hi", "--temperature", "nan", "Second"], ["--temperature", "finite"]),
    (["generate", "Hi", "--dtype", "float8", "Second"], ["--dtype", "invalid choice: 'float8'"]),
    (["generate", "Hi", "--json=yes"], ["--json: ignored explicit argument 'yes'"]),
    (["convert", "src"], ["required: out"]),
    (["convert", "src", "--dtype", "float32", "out", "extra"], ["unrecognized arguments: extra"]),
    (["info", "--tokens", "8", "prompt"], ["unrecognized arguments: prompt"]),
    (["eval", "ppl", "--windows", "2", "text"], ["unrecognized arguments: text"]),
    (["--json", "generate", "Hi"], ["unrecognized arguments: --json"]),
]


@pytest.mark.parametrize("argv, words", MISTAKES, ids=[" ".join(argv) for argv, _ in MISTAKES])
def test_real_mistakes_are_one_line(capsys, argv, words):
  one_line_error(capsys, argv, *words)


@pytest.mark.usefixtures("default_model_once")
def test_intermixed_prompts_generate_as_a_batch(capsys):
  """The issue's command generates both prompts with KIVI, the same tokens as with the prompts first."""
  def json_of(*argv):
    capsys.readouterr()
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)
  mixed = json_of("generate", "Hi", "--method", "kivi", "Second prompt", "--max-new-tokens", "4", "--json")
  first = json_of("generate", "Hi", "Second prompt", "--method", "kivi", "--max-new-tokens", "4", "--json")
  assert mixed["method"] == "kivi" and mixed["batch"] == 2 and len(mixed["text"]) == 2
  assert mixed["tokens"] == first["tokens"] and mixed["text"] == first["text"]
