"""ALFWorld (text): the env (:mod:`.env`, TextWorld games in worker processes) and its data (:mod:`.data`:
the paper's task lists, the packaged valid_seen list and the games, located, verified, downloaded;
:mod:`.expert`: every game of a split played by its stored walkthrough)."""

from .data import (
    ALFWORLD_ARCHIVE,
    ALFWORLD_GAME_FOLDERS,
    ALFWORLD_ROOT,
    ALFWORLD_SPLIT_FILES,
    AlfWorldTask,
    alfworld_dir,
    alfworld_games_root,
    alfworld_tasks,
    build_alfworld_manifest,
    download_alfworld,
    unpack_alfworld_games,
)
from .env import EVAL_OFFSET, EVAL_SEEN_OFFSET, SYSTEM_PROMPT, AlfWorldEnv, EnvWorkerError, check_data

__all__ = ["ALFWORLD_ARCHIVE", "ALFWORLD_GAME_FOLDERS", "ALFWORLD_ROOT", "ALFWORLD_SPLIT_FILES", "EVAL_OFFSET",
           "EVAL_SEEN_OFFSET",
           "SYSTEM_PROMPT", "AlfWorldEnv", "AlfWorldTask", "EnvWorkerError", "alfworld_dir", "alfworld_games_root",
           "alfworld_tasks", "build_alfworld_manifest", "check_data", "download_alfworld", "unpack_alfworld_games"]
