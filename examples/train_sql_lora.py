"""Train the example "sql-lora" adapter: the default model answers questions in SQL.

Runs on the CPU in a few minutes with PEFT. The data set is written below: about
seventy questions over a small shop / HR schema, each answered with one SQL
statement, in the default model's chat format (loss on the answer only).

    python examples/train_sql_lora.py                 # writes examples/adapters/sql-lora/
    python examples/train_sql_lora.py --out /tmp/x --epochs 2

The repository ships the result in ``examples/adapters/sql-lora/`` so the demo works
out of the box; rerun this script only to change it. At the end it prints what
the base model and the adapter answer to a few questions not in the training set.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from loramux.engine.default_model import default_model_path

OUT_DIR = Path(__file__).resolve().parent / "adapters" / "sql-lora"

# (question, SQL answer). Tables: employees(id, name, department, salary, hire_date,
# manager_id), customers(id, name, country, city, email), orders(id, customer_id,
# order_date, total, status), products(id, name, category, price, stock),
# order_items(order_id, product_id, quantity).
# fmt: off
PAIRS: list[tuple[str, str]] = [
    ("How many employees are there?", "SELECT COUNT(*) FROM employees;"),
    ("List the names of all employees.", "SELECT name FROM employees;"),
    ("Show all customers from Germany.", "SELECT * FROM customers WHERE country = 'Germany';"),
    ("What is the average salary of employees?", "SELECT AVG(salary) FROM employees;"),
    ("Find the highest salary in the company.", "SELECT MAX(salary) FROM employees;"),
    ("Which employees work in the Sales department?", "SELECT name FROM employees WHERE department = 'Sales';"),
    ("How many customers live in Paris?", "SELECT COUNT(*) FROM customers WHERE city = 'Paris';"),
    ("List all products that cost more than 100 dollars.", "SELECT name, price FROM products WHERE price > 100;"),
    ("Show the ten most expensive products.", "SELECT name, price FROM products ORDER BY price DESC LIMIT 10;"),
    ("What is the total revenue from all orders?", "SELECT SUM(total) FROM orders;"),
    ("How many orders has each customer placed?", "SELECT customer_id, COUNT(*) AS order_count FROM orders GROUP BY customer_id;"),
    ("List the departments and how many employees each has.", "SELECT department, COUNT(*) FROM employees GROUP BY department;"),
    ("Find employees hired after January 1, 2020.", "SELECT name, hire_date FROM employees WHERE hire_date > '2020-01-01';"),
    ("Show all orders with status shipped.", "SELECT * FROM orders WHERE status = 'shipped';"),
    ("Which products are out of stock?", "SELECT name FROM products WHERE stock = 0;"),
    ("Get the email addresses of customers in Canada.", "SELECT email FROM customers WHERE country = 'Canada';"),
    ("What is the average order total?", "SELECT AVG(total) FROM orders;"),
    ("List the customers sorted by name.", "SELECT name FROM customers ORDER BY name;"),
    ("How many products are in the Books category?", "SELECT COUNT(*) FROM products WHERE category = 'Books';"),
    ("Show the names of customers who placed an order over 500 dollars.", "SELECT DISTINCT c.name FROM customers c JOIN orders o ON o.customer_id = c.id WHERE o.total > 500;"),
    ("Find the department with the highest average salary.", "SELECT department, AVG(salary) AS avg_salary FROM employees GROUP BY department ORDER BY avg_salary DESC LIMIT 1;"),
    ("Delete all cancelled orders.", "DELETE FROM orders WHERE status = 'cancelled';"),
    ("Increase the price of every product by ten percent.", "UPDATE products SET price = price * 1.1;"),
    ("Add a new customer named Alice from Spain.", "INSERT INTO customers (name, country) VALUES ('Alice', 'Spain');"),
    ("List the product categories without duplicates.", "SELECT DISTINCT category FROM products;"),
    ("Which customers have never placed an order?", "SELECT name FROM customers WHERE id NOT IN (SELECT customer_id FROM orders);"),
    ("Show each employee with the name of their manager.", "SELECT e.name, m.name AS manager FROM employees e LEFT JOIN employees m ON e.manager_id = m.id;"),
    ("What is the total quantity sold of each product?", "SELECT product_id, SUM(quantity) FROM order_items GROUP BY product_id;"),
    ("Find the five most recent orders.", "SELECT * FROM orders ORDER BY order_date DESC LIMIT 5;"),
    ("How many orders were placed in 2023?", "SELECT COUNT(*) FROM orders WHERE order_date BETWEEN '2023-01-01' AND '2023-12-31';"),
    ("List employees earning between 50000 and 80000.", "SELECT name, salary FROM employees WHERE salary BETWEEN 50000 AND 80000;"),
    ("Which countries do our customers come from?", "SELECT DISTINCT country FROM customers;"),
    ("Count the customers in each country.", "SELECT country, COUNT(*) FROM customers GROUP BY country;"),
    ("Show the cheapest product.", "SELECT name, price FROM products ORDER BY price ASC LIMIT 1;"),
    ("Find customers whose name starts with J.", "SELECT name FROM customers WHERE name LIKE 'J%';"),
    ("What is the total salary paid to the Engineering department?", "SELECT SUM(salary) FROM employees WHERE department = 'Engineering';"),
    ("List orders together with the customer name.", "SELECT o.id, c.name, o.total FROM orders o JOIN customers c ON o.customer_id = c.id;"),
    ("Which departments have more than ten employees?", "SELECT department FROM employees GROUP BY department HAVING COUNT(*) > 10;"),
    ("Show products with fewer than five items in stock.", "SELECT name, stock FROM products WHERE stock < 5;"),
    ("Give me the average price per category.", "SELECT category, AVG(price) FROM products GROUP BY category;"),
    ("Who is the newest employee?", "SELECT name FROM employees ORDER BY hire_date DESC LIMIT 1;"),
    ("Mark order 42 as delivered.", "UPDATE orders SET status = 'delivered' WHERE id = 42;"),
    ("Remove the product with id 7.", "DELETE FROM products WHERE id = 7;"),
    ("How many distinct cities do customers live in?", "SELECT COUNT(DISTINCT city) FROM customers;"),
    ("List all pending orders sorted by date.", "SELECT * FROM orders WHERE status = 'pending' ORDER BY order_date;"),
    ("Find the customer who spent the most money.", "SELECT c.name, SUM(o.total) AS spent FROM customers c JOIN orders o ON o.customer_id = c.id GROUP BY c.name ORDER BY spent DESC LIMIT 1;"),
    ("Show employees without a manager.", "SELECT name FROM employees WHERE manager_id IS NULL;"),
    ("What is the lowest salary in the Marketing department?", "SELECT MIN(salary) FROM employees WHERE department = 'Marketing';"),
    ("List the products ordered in order 15.", "SELECT p.name, oi.quantity FROM order_items oi JOIN products p ON p.id = oi.product_id WHERE oi.order_id = 15;"),
    ("How many products does each category contain?", "SELECT category, COUNT(*) FROM products GROUP BY category;"),
    ("Show customers from London or Berlin.", "SELECT name, city FROM customers WHERE city IN ('London', 'Berlin');"),
    ("Give every employee in Support a 5 percent raise.", "UPDATE employees SET salary = salary * 1.05 WHERE department = 'Support';"),
    ("Find orders with a total above the average order total.", "SELECT * FROM orders WHERE total > (SELECT AVG(total) FROM orders);"),
    ("List employees whose email is missing.", "SELECT name FROM employees WHERE email IS NULL;"),
    ("What was the revenue per month in 2024?", "SELECT strftime('%m', order_date) AS month, SUM(total) FROM orders WHERE order_date LIKE '2024%' GROUP BY month;"),
    ("Show the second page of customers, ten per page.", "SELECT * FROM customers ORDER BY id LIMIT 10 OFFSET 10;"),
    ("Which products have never been ordered?", "SELECT name FROM products WHERE id NOT IN (SELECT product_id FROM order_items);"),
    ("Count the orders by status.", "SELECT status, COUNT(*) FROM orders GROUP BY status;"),
    ("Add a product called Lamp in the Home category priced at 25.", "INSERT INTO products (name, category, price) VALUES ('Lamp', 'Home', 25);"),
    ("List the three departments with the most employees.", "SELECT department, COUNT(*) AS n FROM employees GROUP BY department ORDER BY n DESC LIMIT 3;"),
    ("Find the total spent by customer 12.", "SELECT SUM(total) FROM orders WHERE customer_id = 12;"),
    ("Show the name and salary of the best paid employee.", "SELECT name, salary FROM employees ORDER BY salary DESC LIMIT 1;"),
    ("How many customers have a gmail address?", "SELECT COUNT(*) FROM customers WHERE email LIKE '%@gmail.com';"),
    ("List all employees in alphabetical order with their department.", "SELECT name, department FROM employees ORDER BY name;"),
    ("What is the most popular product?", "SELECT product_id, SUM(quantity) AS sold FROM order_items GROUP BY product_id ORDER BY sold DESC LIMIT 1;"),
    ("Tell me how many orders were cancelled.", "SELECT COUNT(*) FROM orders WHERE status = 'cancelled';"),
    ("Who are our customers in Japan?", "SELECT name FROM customers WHERE country = 'Japan';"),
    ("Get the price of the product named Keyboard.", "SELECT price FROM products WHERE name = 'Keyboard';"),
]
# fmt: on

# Not in the training set: printed after training to show the difference.
HELD_OUT = [
    "How many employees work in the Engineering department?",
    "List all customers from Italy.",
    "What is the total value of orders placed by customer 3?",
]


def build_example(tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of the chat-formatted example and labels masking everything but the answer."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
    ids = prompt_ids + answer_ids
    labels = [-100] * len(prompt_ids) + answer_ids
    return ids, labels


def collate(batch, pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


@torch.no_grad()
def answer(model, tokenizer, question: str, max_new_tokens: int = 40) -> str:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(
        **ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--base", type=Path, default=None, help="base model folder (default model)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    base = args.base or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    model.print_trainable_parameters()

    examples = [build_example(tokenizer, q, a) for q, a in PAIRS]
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0
    )
    steps_per_epoch = (len(examples) + args.batch_size - 1) // args.batch_size
    total_steps = steps_per_epoch * args.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: max(0.05, 1.0 - step / total_steps)
    )
    model.train()
    start = time.perf_counter()
    for epoch in range(args.epochs):
        random.shuffle(examples)
        losses = []
        for i in range(0, len(examples), args.batch_size):
            batch = collate(examples[i : i + args.batch_size], tokenizer.pad_token_id)
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        print(
            f"epoch {epoch + 1}/{args.epochs}  loss {sum(losses) / len(losses):.4f}  "
            f"{time.perf_counter() - start:.0f}s",
            flush=True,
        )

    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    # Point the config at the default model's name instead of a machine-local path.
    config_path = args.out / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    saved["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    (args.out / "README.md").write_text(
        "# sql-lora\n\n"
        f"A rank-{args.rank} LoRA adapter for SmolLM2-135M-Instruct (q/k/v/o projections) that answers\n"
        "questions with one SQL statement. Trained by `examples/train_sql_lora.py` on the\n"
        f"{len(PAIRS)} question/SQL pairs written in that script ({args.epochs} epochs, CPU).\n"
    )
    print(f"saved the adapter to {args.out}")

    for question in HELD_OUT:
        tuned = answer(model, tokenizer, question)
        with model.disable_adapter():
            plain = answer(model, tokenizer, question)
        print(f"\nQ: {question}\n  base:     {plain}\n  sql-lora: {tuned}")


if __name__ == "__main__":
    main()
