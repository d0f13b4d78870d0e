"""SAO: verl registrations, the streamed actor and critic updates, the trainer step."""
