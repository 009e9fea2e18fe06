"""The trial report: built in the workflow, rendered as Markdown, HTML and JSON."""
