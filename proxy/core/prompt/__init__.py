"""What a request says: fingerprints of its prompt, its body and headers, and what the answer
reports."""
