"""``python -m flowrl.reward_server server.yaml [--port N]``."""

import sys

from flowrl.reward_server import main

sys.exit(main())
