"""Preference collection: offline (winner, loser) pairs for Diffusion-DPO and D3PO, a person's labels of them, and
the local labelling page that records those labels."""
