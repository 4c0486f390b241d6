"""What is checked about a user's inputs and extensions, in one room."""
