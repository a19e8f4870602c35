"""What a person sees of a job: its history, goodput and downtime, metrics, reports, the
live line."""
