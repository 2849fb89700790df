"""Runtime: the device layer (`device`) and the colocated phase scheduler (`phases`)."""
