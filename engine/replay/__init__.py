"""Traffic replay: requests from a traffic profile, driven through an engine; measurement tiers."""
