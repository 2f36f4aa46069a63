"""The data sets behind the embedded models: digits images and prompts, moving-digit clips, arithmetic
word problems. The bottom layer (it imports nothing of flowrl's), so the pipelines that are trained on
these data, the rewards trained on them (the digit classifier) and the prompt sources can all read them."""
