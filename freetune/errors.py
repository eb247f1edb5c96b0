"""The one exception a user should ever see from freetune: it says what went wrong and what to change."""


class FreetuneError(Exception):
    """A problem with the user's input or machine, found before (or instead of) spending GPU time.

    The message is written for the person at the notebook: what is wrong, then what to change.
    """


def reason(exc: BaseException, limit: int = 300) -> str:
    """An exception's message to quote inside a sentence: its first `limit` characters, no trailing period."""
    text = " ".join(str(exc).split())
    return text[:limit].rstrip(".") + " ..." if len(text) > limit else text.rstrip(".")
