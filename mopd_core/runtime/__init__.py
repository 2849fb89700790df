"""Runtime: the device layer (`device`) — later also the Ray cluster helpers."""
