"""Measuring what ran: timelines, traces, profiles, memory, and when communication hides."""
