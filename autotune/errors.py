"""The two ways a search refuses or stops, which the command line turns into exit codes."""


class SearchError(RuntimeError):
    """A search refused as asked (its flags, or the files and storage they name): exit 2."""


class SearchStopped(SearchError):
    """A search that cannot go on though it was asked for correctly: exit 1. The trials so far are saved."""

