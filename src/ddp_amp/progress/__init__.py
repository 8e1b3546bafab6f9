"""Progress: workers emit small events (no rich there); the launcher receives and renders them."""
