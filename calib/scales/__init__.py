"""From statistics to scales: what a capture hands on (stats), folding ranges into the scales a recipe asks
for (fold), the engine's cache write emulated in float32 (quant), and FP8 format facts (fp8)."""
