"""User errors: the one exception type for problems with what the user gave (a config
field, a data file, a flag, a workdir), and the wrapper every command line's `main` uses.

A UserError ends a command with ONE line on stderr, `error: <message>`, and exit status 2;
no traceback unless --verbose is given or TRANSFORMER_JAX_TRACEBACK=1 is set. Anything else
is a bug or an environment failure and keeps its traceback.

  from transformer_jax import errors

  if __name__ == "__main__":
    errors.run(main)          # absl's app.run(main), with the above
"""

from __future__ import annotations

import errno
import functools
import os
import sys
import sysconfig
import traceback
from typing import Any, Callable, NoReturn, TypeVar

EXIT_STATUS = 2
TRACEBACK_ENV = "TRANSFORMER_JAX_TRACEBACK"
F = TypeVar("F", bound=Callable[..., Any])


class UserError(ValueError):
  """A problem the user can fix: the message names the field, file or line, and the fix.
  A ValueError, so that code catching ValueError (and older tests) still does."""


class MissingFileError(UserError, FileNotFoundError):
  """A file or directory the user named (or that a command needs) does not exist."""


def tracebacks_wanted() -> bool:
  """--verbose on the command line, or TRANSFORMER_JAX_TRACEBACK=1 in the environment."""
  if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
    return True
  from absl import flags
  return bool(flags.FLAGS.is_parsed() and "verbose" in flags.FLAGS and flags.FLAGS.verbose)


def exit_with(error: BaseException) -> NoReturn:
  """Ends the program with the user error's one line on stderr and status 2."""
  sys.stdout.flush()
  sys.stderr.write(f"error: {error}\n")
  sys.stderr.flush()
  raise SystemExit(EXIT_STATUS)


# A file system that refuses writes (full, over quota, read-only): the user frees space or
# picks another directory; whatever wrote last (metrics, a tokenizer, an output) is named.
_REFUSED_WRITES = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def refused_write(error: OSError) -> UserError | None:
  """The user error for an OSError of a file system that refuses writes, else None."""
  if error.errno not in _REFUSED_WRITES:
    return None
  where = f"{error.filename}: " if error.filename else ""
  return UserError(f"{where}{(error.strerror or str(error)).lower()} (free space or choose "
                   "another directory; a training run resumes from its last checkpoint)")


def user_errors(main: F) -> F:
  """Decorator: a UserError raised by `main`, or a write the file system refuses (disk
  full, read-only), ends the program with one line and status 2 (re-raised with its
  traceback when tracebacks are wanted)."""
  @functools.wraps(main)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    try:
      return main(*args, **kwargs)
    except UserError as e:
      if tracebacks_wanted():
        raise
      exit_with(e)
    except OSError as e:
      problem = refused_write(e)
      if problem is None or tracebacks_wanted():
        raise
      exit_with(problem)
  return wrapped  # type: ignore[return-value]


def unknown_config_field(error: AttributeError | KeyError) -> UserError:
  """The user error for a `--config.<field>=...` override of a field the config file does
  not define (ml_collections raises AttributeError(KeyError("'name'\nDid you mean..."))."""
  detail: Any = error
  while isinstance(detail, (AttributeError, KeyError)) and detail.args:
    detail = detail.args[0]
  overrides = [a.split("=")[0] for a in sys.argv[1:] if a.startswith("--config.")]
  return UserError(f"unknown config field {detail} (overrides given: {overrides}); the "
                   "config file lists the valid fields")


def config_file_error(error: BaseException) -> UserError | None:
  """The user error for a config file (`--config=FILE`) that fails to load: a syntax error,
  or an exception raised by its own code, named by file and line. None if `error` did not
  come from a file of the user's (its innermost frames are all in installed packages)."""
  if isinstance(error, SyntaxError) and error.filename:
    return UserError(f"{error.filename}:{error.lineno}: {error.msg} (the config file does not "
                     "parse; fix that line)")
  library_dirs = (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"],
                  os.path.dirname(os.path.abspath(__file__)))
  for frame in reversed(traceback.extract_tb(error.__traceback__)):
    path = os.path.abspath(frame.filename)
    if frame.filename.startswith("<") or path.startswith(library_dirs):
      continue
    if path == os.path.abspath(sys.argv[0]):
      return None   # The command itself: a bug, not the user's file.
    return UserError(f"{frame.filename}:{frame.lineno}: {type(error).__name__}: {error} (the "
                     "config file raised this while loading; fix it)")
  return None


def run(main: Callable[[list[str]], Any]) -> None:
  """absl's `app.run(main)` for a command line: adds --verbose and reports user errors
  in one line (see the module doc), including a flag's bad value and an override of a field
  that a --config file lacks (ml_collections applies those while absl parses the flags,
  before `main`)."""
  from absl import app, flags
  if "verbose" not in flags.FLAGS:
    flags.DEFINE_bool("verbose", False, "On a user error, print the traceback too "
                      f"(also: {TRACEBACK_ENV}=1).")
  started = []

  def begin(argv: list[str]) -> Any:
    started.append(True)
    return user_errors(main)(argv)

  def parse_flags(argv: list[str]) -> list[str]:
    # absl's own parser prints a flag's bad value in two lines and exits with status 1.
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      if tracebacks_wanted():
        raise
      exit_with(UserError(f"{e} (flags: --helpfull)"))
    except Exception as e:  # Loading a --config file runs the user's code.
      problem = config_file_error(e)
      if problem is None or tracebacks_wanted():
        raise
      exit_with(problem)
  try:
    app.run(begin, flags_parser=parse_flags)
  except (AttributeError, KeyError) as e:
    if started or tracebacks_wanted():
      raise
    exit_with(unknown_config_field(e))
