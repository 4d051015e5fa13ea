"""`astuner.remote` is the remote agents' client, `astuner_remote` (also installable alone, without torch:
`pip install ./clients/remote`). Kept under this name for code written against it."""

from astuner_remote import RemoteClient, RemoteEpisode, RemoteError  # noqa: F401
