"""`python -m calib.recipe.support`: print the support matrix as the README's table (calib.recipe.support.matrix)."""

from __future__ import annotations

from calib.recipe.support.matrix import markdown

if __name__ == "__main__":
    print(markdown(), end="")
