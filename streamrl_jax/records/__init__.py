"""What a run leaves in its workdir: its record across resumes (run_record), metrics.jsonl and the trackers it feeds
(metrics_log), its pictures (pictures) and the comparison of several arms' outputs (comparison)."""
