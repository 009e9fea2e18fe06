"""Local cluster: `switchyard up` and the main job."""
