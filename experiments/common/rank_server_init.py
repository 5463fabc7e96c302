"""The first module the ranks' forkserver imports (`rank_server.PRELOAD`): it readies the server
(`rank_server.as_server`) before torch's import, the seconds a signal most likely comes in.
Nothing else imports it (imported elsewhere, it would ignore that process's Ctrl-C); the ranks
fork from the server with it imported already."""

import os

from experiments.common.rank_server import PARENT_VAR, as_server

if os.environ.get(PARENT_VAR):  # set by the command that starts the server
    as_server()
